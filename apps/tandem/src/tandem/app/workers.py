"""`tandem workers add|remove|show`: resize a running RL run's pool of rollout workers.

The run's driver keeps a `PoolControl` actor named after the run on its Ray cluster and
follows its target within a second: new workers start with one catch-up pull of the weights,
leaving ones are drained (they finish their groups and get no new one); a worker the
cluster has no room for stays pending until a node joins or another worker leaves. This
command only changes the target and reports what the driver reports, so it works from any
machine that can reach the cluster.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

SETTLE_S = 5.0
"""How long `add`/`remove` wait for the driver to act on the new target before reporting."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "workers",
        help="add or remove rollout workers of a running RL run on a Ray cluster",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("action", choices=["add", "remove", "show"])
    p.add_argument("count", nargs="?", type=int, default=1, help="how many (default 1)")
    p.add_argument("--address", required=True, help="the Ray cluster, e.g. auto or HOST:6379")
    p.add_argument("--run", required=True, help="the run's name (run.name of its config)")


def run_workers(args: argparse.Namespace) -> int:
    if args.count < 1:
        print(f"tandem workers: count must be >= 1, got {args.count}", file=sys.stderr)
        return 2
    import ray

    from tandem.orchestrator import RAY_NAMESPACE, ConfigValueError, join_cluster, pool_name

    try:
        join_cluster(args.address, namespace=RAY_NAMESPACE, log_to_driver=False)
    except ConfigValueError as e:
        print(f"tandem workers: {e}", file=sys.stderr)
        return 2
    try:
        try:
            control = ray.get_actor(pool_name(args.run), namespace=RAY_NAMESPACE)
        except ValueError:
            print(
                f"tandem workers: no running RL run named {args.run!r} on the cluster at "
                f'{args.address!r} (is its rl.backend "ray"?)',
                file=sys.stderr,
            )
            return 2
        delta = {"add": args.count, "remove": -args.count, "show": 0}[args.action]
        target = ray.get(control.resize.remote(delta))
        status = _settled(control, target) if delta else ray.get(control.status.remote())
        print(f"run {args.run}: {describe(status)}")
        short = unplaceable(status, ray.available_resources())
        if short:
            print(f"tandem workers: warning: {short}", file=sys.stderr)
        return 0
    finally:
        ray.shutdown()


def _settled(control: Any, target: int) -> dict[str, Any]:
    """The driver's report once it has acted on ``target`` (or after `SETTLE_S`)."""
    import ray

    deadline = time.monotonic() + SETTLE_S
    while True:
        status = ray.get(control.status.remote())
        if status["running"] + status["pending"] == target or time.monotonic() > deadline:
            return status
        time.sleep(0.25)


def describe(status: dict[str, Any]) -> str:
    """``3 rollout workers wanted: 2 running, 1 pending``."""
    line = f"{status['target']} rollout workers wanted: {status['running']} running"
    return line + (f", {status['pending']} pending" if status["pending"] else "")


def unplaceable(status: dict[str, Any], free: dict[str, float]) -> str:
    """Why the pending workers cannot be placed now ('' when the cluster has room for
    them): each declares `PoolControl.worker_resources`, which the free resources lack."""
    pending = status["pending"]
    if not pending:
        return ""
    lacking = [
        f"{amount:g} {kind}"
        for kind, amount in status["worker_resources"].items()
        if amount and free.get(kind, 0.0) + 1e-9 < amount
    ]
    if not lacking:
        return ""
    have = ", ".join(
        f"{free.get(k, 0.0):g} {k}" for k, v in status["worker_resources"].items() if v
    )
    return (
        f"{pending} rollout worker(s) pending: each declares {' and '.join(lacking)} and the "
        f"cluster has {have} free; they start when a node joins or a worker leaves "
        "(or lower rl.ray.worker_cpus / worker_gpus in the run's config)"
    )
