"""Scaling out: rollout throughput with 1, 2 and 4 Ray rollout workers, and weight flow
from `publish` to "every engine on the new version" directly versus through a relay.

Part 1 starts a Ray cluster on loopback, publishes the demo config's policy (its model
shape, freshly initialised: the point is the inference load, not the answers) to a local
weight store, and for each pool size lets `RayRollouts` play groups of the demo's tasks as
fast as it can: ``--groups`` groups (the same tasks for every pool size) after a warm-up
group per worker; it prints trajectories/s and the ratio to one worker. Turns are decoded to the token budget (no early stop on
malformed calls), so every trajectory costs the same decoding work. On a machine with C
cores, more than C single-threaded workers cannot add throughput; the figures say how close
the pool gets to that.

Part 2 runs `weight_flow.py` (the S3 origin on loopback, two regions of engines, relay per
region versus direct pulls) and prints its table.

    uv run python benchmarks/scale.py [--workers 1 2 4] [--groups 16] [--skip-flow]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

ROOT = Path(__file__).resolve().parents[1]


def demo_config():
    from tandem.app.config import load_config
    from tandem.app.pipeline_config import PipelineConfig

    return load_config(PipelineConfig, ROOT / "configs" / "demo.toml")


async def measure(pool: int, groups: int, store_dir: Path, cfg, policy) -> dict[str, float]:
    from tandem.orchestrator.backends.ray.rollouts import RayRollouts
    from tandem.orchestrator.backends.ray.worker import WorkerSpec
    from tandem.orchestrator.config import RayConfig

    engine = msgspec.structs.replace(cfg.engine, stop_malformed=False)
    spec = WorkerSpec(
        model=policy.config,
        engine=engine,
        env=msgspec.structs.replace(cfg.env, allow_unsandboxed=True),
        episode=cfg.episode,
        tasks=cfg.tasks,
        task_seed=cfg.tasks.train_seed,
        task_offset=0,
        seed=0,
        group_size=cfg.rl.group_size,
        store_url=str(store_dir),
    )
    rollouts = RayRollouts(spec, RayConfig(workers=pool, worker_cpus=1), run_name=f"scale{pool}")
    t0 = time.perf_counter()
    await rollouts.start(follow=False)
    start_s = time.perf_counter() - t0
    await asyncio.gather(*(rollouts.play(10_000 + i) for i in range(pool)))  # warm-up
    done = 0
    t0 = time.perf_counter()
    queue = list(range(groups))  # the same groups for every pool size

    async def lane() -> None:
        nonlocal done
        while queue:
            played = await rollouts.play(queue.pop(0))
            done += len(played.samples)

    # two groups in flight per worker keep every engine's batch full between groups
    await asyncio.gather(*(lane() for _ in range(2 * pool)))
    wall = time.perf_counter() - t0
    stats = await rollouts.stats()
    await rollouts.close()
    return {
        "workers": pool,
        "trajectories": done,
        "seconds": wall,
        "traj_s": done / wall,
        "tokens_sampled": stats.tokens_sampled,
        "start_s": start_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--groups", type=int, default=16, help="groups timed per pool size")
    parser.add_argument("--skip-flow", action="store_true")
    args = parser.parse_args()

    import ray
    import structlog

    from tandem.orchestrator import build_model
    from tandem.orchestrator.inference.chat_format import ChatFormat
    from tandem.orchestrator.training.weights import WeightPublisher

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    cfg = demo_config()
    policy = build_model(cfg.model, ChatFormat().tok, seed=cfg.midtrain.init_seed)
    with tempfile.TemporaryDirectory() as tmp:
        from tandem.delta_sync import LocalStore

        store_dir = Path(tmp) / "weights"
        store_dir.mkdir()
        publisher = WeightPublisher(LocalStore(str(store_dir)), policy, anchor_every=20)
        publisher.publish(0)
        publisher.close()
        ray.init(num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False)
        rows = []
        for pool in args.workers:
            rows.append(asyncio.run(measure(pool, args.groups, store_dir, cfg, policy)))
            print(
                f"  {pool} workers: {rows[-1]['trajectories']} trajectories in "
                f"{rows[-1]['seconds']:.1f} s",
                flush=True,
            )
        ray.shutdown()
    base = rows[0]["traj_s"]
    print(f"\nrollout throughput, demo model, {os.cpu_count()} CPU cores, Ray on loopback")
    print(f"{'workers':>8} {'traj/s':>8} {'x 1 worker':>11} {'actor start s':>14}")
    for r in rows:
        print(
            f"{r['workers']:>8} {r['traj_s']:>8.2f} {r['traj_s'] / base:>11.2f} "
            f"{r['start_s']:>14.1f}"
        )
    if not args.skip_flow:
        print("\nweight flow: publish -> every engine on the version, relay vs direct")
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "weight_flow.py")], check=True)


if __name__ == "__main__":
    main()
