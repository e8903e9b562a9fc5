"""`tandem workers add|remove|show`: resize a running RL run's pool of rollout workers.

The run's driver keeps a `PoolControl` actor named after the run on its Ray cluster and
follows its target within a second: new workers start with one catch-up pull of the weights,
leaving ones are drained (they finish their groups and get no new one). This command only
changes the target, so it works from any machine that can reach the cluster.
"""

from __future__ import annotations

import argparse
import os
import sys


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
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # a client ships no code
    import ray

    from tandem.orchestrator import RAY_NAMESPACE, pool_name

    try:
        ray.init(address=args.address, namespace=RAY_NAMESPACE, log_to_driver=False)
    except (ConnectionError, RuntimeError) as e:
        print(
            f"tandem workers: cannot reach a Ray cluster at {args.address!r}: {e}", file=sys.stderr
        )
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
        print(f"run {args.run}: {target} rollout workers")
        return 0
    finally:
        ray.shutdown()
