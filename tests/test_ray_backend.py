"""The ``ray`` backend on a Ray cluster started here on loopback.

Checks: three ``pipelined`` steps of the demo config (rollouts of the next step overlap
training, in lock step) with two rollout actors and a 2-process FSDP trainer (gloo; each
rank publishes only its own shards) end with the
same weights, bit for bit, as the same config on the ``local`` backend (the mode pins which
weights play which group; the engine is batch-invariant, so where a group runs does not
change its samples; the local trainer accumulates as two ranks would; the Ray run's
sandboxes live in an environment-pool actor; both trainers keep the KL penalty's reference
policy), and every actor's engine equals the trainer
after each step; an actor killed with SIGKILL in the middle of
its groups is replaced and its groups are played again, with no partial group reaching the
trainer; workers join (one catch-up pull) and leave (drained) while training runs, pulling
through a relay, and the metrics show the pool size; a worker joining a pool that does
not follow the store starts on the pool's version, not the newest.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import msgspec
import pytest
import torch

# workers start from this interpreter; Ray's `uv run` hook would re-create the environment
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
ray = pytest.importorskip("ray")

from rl_helpers import TinyRun, parity, tiny_run  # noqa: E402

from tandem.app.config import load_config  # noqa: E402
from tandem.app.pipeline_config import PipelineConfig  # noqa: E402
from tandem.delta_sync import LocalStore, RelayStore, Subscriber  # noqa: E402
from tandem.delta_sync.server import StoreServer  # noqa: E402
from tandem.orchestrator.artifacts.metrics import read_metrics  # noqa: E402
from tandem.orchestrator.backends.ray.worker import state_digest  # noqa: E402
from tandem.orchestrator.config import RayConfig, RLConfig  # noqa: E402
from tandem.orchestrator.inference.chat_format import ChatFormat  # noqa: E402
from tandem.orchestrator.policy import build_model  # noqa: E402
from tandem.orchestrator.rl.hooks import RunHooks  # noqa: E402
from tandem.orchestrator.shards import shard_name  # noqa: E402
from tandem.orchestrator.training.weights import (  # noqa: E402
    state_for_sync,
    stream_store,
    weights_equal,
)

RAY = RayConfig(workers=2, worker_cpus=1, poll_s=0.5)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=5, namespace="tandem", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _worker_digests(run) -> list[tuple[int, str]]:
    return ray.get([w.handle.digest.remote() for w in run.rollouts.live])


def _demo_run(run_dir: Path, rl: RLConfig, hooks: RunHooks) -> TinyRun:
    """An RL run with the demo config's model, tasks, episodes, engine and trainer (a fresh
    model: what matters here is that both backends compute the same numbers)."""
    cfg = load_config(PipelineConfig, ROOT / "configs" / "demo.toml")
    config = msgspec.structs.replace(
        cfg,
        run=msgspec.structs.replace(cfg.run, name=run_dir.name, seed=0),
        rl=rl,
        # FSDP by default; a KL penalty, so every rank also scores with the reference policy
        trainer=msgspec.structs.replace(
            cfg.trainer,
            processes=2,
            loss=msgspec.structs.replace(cfg.trainer.loss, kl_coef=0.05),
        ),
        env=msgspec.structs.replace(cfg.env, allow_unsandboxed=True),
    )
    return TinyRun(build_model(config.model, ChatFormat().tok), config, run_dir, hooks)


def test_two_rollout_actors_and_two_trainer_ranks_give_the_local_weights(
    tmp_path: Path, cluster
) -> None:
    demo = load_config(PipelineConfig, ROOT / "configs" / "demo.toml").rl
    # two groups a step, one per trainer rank, of four: what is checked needs no more
    rl = msgspec.structs.replace(
        demo,
        backend="local",
        mode="pipelined",
        steps=3,
        groups_per_step=2,
        group_size=4,
        checkpoint_every=10,
    )
    # one process accumulating as two ranks would; CPU kernels split work by thread, so it
    # runs with the ranks' one thread each
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = _demo_run(tmp_path / "local", rl, RunHooks(reward=parity))
        local_summary = local.run()
    finally:
        torch.set_num_threads(threads)

    engine_checks: list[bool] = []
    pools: list[dict] = []
    actor_pids: list[int] = []

    nices: dict[str, list[set[int]]] = {}

    def thread_nices(_actor: object) -> set[int]:  # run inside an actor: its threads' values
        return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}

    async def pool_figures() -> None:  # after each step: the last call's figures are kept
        pools[:] = await remote.rollouts.env_pool_stats()
        actor_pids[:] = [await w.handle.pid.remote() for w in remote.rollouts.live]
        ranks = remote.backend.trainer.ranks
        nices["trainer"] = [await r.__ray_call__.remote(thread_nices) for r in ranks]
        nices["engines"] = [
            await w.handle.__ray_call__.remote(thread_nices) for w in remote.rollouts.live
        ]

    # the trainer's weights of each version (version 0: the initial ones)
    want: dict[int, str] = {}

    def after_step(step: int, metrics: dict):
        # pipelined: after step k (trainer on k+1) every actor holds version k, the one
        # playing step k+1's groups
        want[remote.loop.version] = state_digest(remote.backend.trainer.weights())
        behind = remote.loop.version - 1
        digests = _worker_digests(remote)
        engine_checks.append(
            len(digests) == 2 and all(v == behind and d == want[behind] for v, d in digests)
        )
        return pool_figures()

    # the sandboxes run in an environment-pool actor, apart from the engines; the trainer
    # ranks give way to the engines on the CPU
    ray_rl = msgspec.structs.replace(
        rl,
        backend="ray",
        ray=msgspec.structs.replace(RAY, torch_threads=1, env_pools=1, trainer_nice=19),
    )
    remote = _demo_run(tmp_path / "ray", ray_rl, RunHooks(reward=parity, on_step=after_step))
    want[0] = state_digest(state_for_sync(remote.policy))
    summary = remote.run()

    assert summary.steps_done == local_summary.steps_done == 3
    assert summary.policy_version == local_summary.policy_version == 3
    assert weights_equal(state_for_sync(remote.policy), state_for_sync(local.policy))
    assert engine_checks == [True, True, True]
    assert summary.staleness_histogram == local_summary.staleness_histogram
    assert summary.staleness_histogram[1] == 2 * rl.groups_per_step  # steps 1 and 2
    assert sorted(remote.rollouts.assigned) == ["rollout-0", "rollout-1"]  # both played
    assert summary.trajectories == local_summary.trajectories
    assert summary.last_metrics["rollout_workers"] == 2
    # the ranks' penalty against the reference: moved away from it, the same as one process
    assert summary.last_metrics["kl"] == pytest.approx(local_summary.last_metrics["kl"], rel=1e-5)
    assert summary.last_metrics["kl"] > 0
    assert 0 < summary.engine_busy_s <= summary.engine_s  # two engines' time in steps
    assert nices["trainer"] == [{19}, {19}]  # every thread of both ranks
    assert len(nices["engines"]) == 2 and all(max(n) < 19 for n in nices["engines"])
    # every episode (kept or dropped) was reset in the pool, none is left open
    played = rl.steps * rl.groups_per_step * rl.group_size
    assert len(pools) == 1 and pools[0]["served"] >= played and pools[0]["open"] == 0
    assert pools[0]["pid"] not in actor_pids and pools[0]["pid"] != os.getpid()
    # FSDP: each rank published only its own dim-0 shards, which the engines reassembled
    store = stream_store(remote.config.rl.weights_store, remote.run_dir, remote.loop.stream)
    published = Subscriber(store).manifest(3).tensors()
    whole = state_for_sync(remote.policy)
    assert set(published) == {shard_name(name, rank, 2) for name in whole for rank in range(2)}


def test_a_killed_actor_is_replaced_and_its_groups_played_again(tmp_path: Path, cluster) -> None:
    rl = RLConfig(
        mode="async",
        steps=5,
        group_size=3,
        groups_per_step=2,
        rollout_workers=4,
        checkpoint_every=10,
        backend="ray",
        ray=RAY,
    )
    groups: list[int] = []
    killed: list[str] = []

    async def kill_a_busy_worker() -> None:
        while not any(w.inflight for w in run.rollouts.live):
            await asyncio.sleep(0.005)
        victim = next(w for w in run.rollouts.live if w.inflight)
        os.kill(await victim.handle.pid.remote(), signal.SIGKILL)
        killed.append(victim.name)

    kill: list[asyncio.Task] = []

    def on_group(group) -> None:
        groups.append(len(group.samples))
        if not kill:  # the first group is back; others are being played
            kill.append(asyncio.get_running_loop().create_task(kill_a_busy_worker()))

    async def on_step(step: int, metrics: dict) -> None:
        if step == 2:
            await kill[0]
            async with asyncio.timeout(180):  # the trainer waits for the replacement
                while "rollout-2" not in [w.name for w in run.rollouts.live]:
                    await asyncio.sleep(0.05)

    hooks = RunHooks(reward=parity, on_step=on_step, on_group=on_group)
    run = tiny_run(tmp_path, rl, hooks)
    summary = run.run()

    assert summary.steps_done == 5 and summary.policy_version == 5
    assert len(killed) == 1
    assert run.rollouts.lost == 1
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[-1]["groups_requeued"] >= 1  # the killed actor had groups in flight
    assert groups and all(n == 3 for n in groups)  # only whole groups reached the trainer
    sizes = [n for _, n in run.rollouts.pool_sizes]
    assert 1 in sizes and sizes[-1] == 2  # it was replaced
    assert "rollout-2" in run.rollouts.assigned  # the replacement took groups
    assert [r["step"] for r in records] == list(range(5))


def test_workers_join_and_leave_while_training_runs(tmp_path: Path, cluster) -> None:
    # the rollout actors pull through a relay in front of the trainer's store (a region's)
    (tmp_path / "weights").mkdir()
    relay = RelayStore(LocalStore(tmp_path / "weights"), LocalStore(tmp_path / "relay-cache"))
    server = StoreServer(relay).start()
    rl = RLConfig(
        mode="async",
        steps=6,
        group_size=3,
        groups_per_step=2,
        rollout_workers=4,
        checkpoint_every=10,
        anchor_every=3,
        backend="ray",
        ray=msgspec.structs.replace(RAY, workers=1, pull_from=server.url),
    )
    joined: list[tuple[int, int]] = []  # (trainer version when asked, version it started on)
    said: list[tuple[int, str]] = []

    async def resize(step: int, metrics: dict) -> None:
        if step == 1:
            version = run.loop.version
            # the command a user runs from any machine that reaches the cluster
            cli = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tandem.app.cli",
                "workers",
                "add",
                "1",
                "--address",
                ray.get_runtime_context().gcs_address,
                "--run",
                run.name,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await cli.communicate()
            said.append((cli.returncode, out.decode()))
            async with asyncio.timeout(180):
                while len(run.rollouts.live) < 2:
                    await asyncio.sleep(0.05)
            joined.append((version, run.rollouts.live[-1].version))
        if step == 4:
            await run.rollouts.resize(-1)
            async with asyncio.timeout(180):
                while len(run.rollouts.workers) > 1:
                    await asyncio.sleep(0.05)

    run = tiny_run(tmp_path, rl, RunHooks(reward=parity, on_step=resize))
    try:
        summary = run.run()
    finally:
        server.stop()

    assert summary.steps_done == 6
    assert said[0][0] == 0 and f"run {run.name}: 2 rollout workers" in said[0][1], said
    assert len(joined) == 1
    asked_at, started_on = joined[0]
    assert started_on >= asked_at  # one catch-up pull brought it to a current version
    assert "rollout-1" in run.rollouts.assigned  # and it took groups
    sizes = [n for _, n in run.rollouts.pool_sizes]
    assert sizes == [1, 2, 1]  # joined, then one drained
    records = read_metrics(tmp_path / "metrics.jsonl")
    pool = [r["rollout_workers"] for r in records]
    assert pool == [1, 1, 2, 2, 2, 1]
    assert relay.stats.origin_gets > 0 and relay.stats.latest_gets > 0  # weights came that way


def test_a_worker_joining_a_pool_that_does_not_follow_starts_on_the_pool_version(
    tmp_path: Path, cluster
) -> None:
    """Without following (sync and pipelined modes) the pool is on the version `sync_to`
    put it on; an actor added then (a replacement) starts there, not on the newest one, so
    the groups it replays get the weights they were meant for."""
    from rl_helpers import ENGINE, ENV, TINY

    from tandem.orchestrator.backends.ray.rollouts import RayRollouts
    from tandem.orchestrator.backends.ray.worker import WorkerSpec
    from tandem.orchestrator.config import EpisodeConfig, TaskConfig
    from tandem.orchestrator.inference.tokenizer import ByteTokenizer
    from tandem.orchestrator.training.weights import WeightPublisher

    policy = build_model(TINY, ByteTokenizer())
    publisher = WeightPublisher(LocalStore(str(tmp_path)), policy, anchor_every=10)
    digests: dict[int, str] = {}

    def publish(version: int) -> None:
        if version:
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
        publisher.publish(version)
        digests[version] = state_digest(state_for_sync(policy))

    publish(0)
    publish(1)
    spec = WorkerSpec(
        model=policy.config,
        engine=ENGINE,
        env=ENV,
        episode=EpisodeConfig(),
        tasks=TaskConfig(),
        task_seed=1,
        task_offset=0,
        seed=0,
        group_size=2,
        store_url=str(tmp_path),
    )
    pool = RayRollouts(spec, msgspec.structs.replace(RAY, workers=1), run_name="pinned")

    async def main() -> list[tuple[int, str]]:
        await pool.start(follow=False)  # the first actor starts on the newest version, 1
        await pool.sync_to(1)
        publish(2)  # as in a pipelined step: the trainer is a version ahead of the pool
        await asyncio.sleep(2 * RAY.poll_s)  # an actor that followed would have pulled it
        await pool.add_worker()
        digests_now = [ray.get(w.handle.digest.remote()) for w in pool.live]
        await pool.close()
        return digests_now

    assert asyncio.run(main()) == [(1, digests[1]), (1, digests[1])]
