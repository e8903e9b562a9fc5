"""A 2-process data-parallel trainer publishes each version per rank, with no gather: each
rank only its partition of the tensors; subscribers reassemble the whole model bit for bit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.delta_sync import LocalStore, Subscriber
from tandem.orchestrator.training.weights import rank_partition, weights_equal

WORKER = Path(__file__).with_name("ranks_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_partition_is_balanced_disjoint_and_complete() -> None:
    sizes = {f"t{i}": (i % 7 + 1) * 100 for i in range(40)}
    parts = rank_partition(sizes, 3)
    names = [n for p in parts for n in p]
    assert sorted(names) == sorted(sizes) and len(names) == len(set(names))
    loads = [sum(sizes[n] for n in p) for p in parts]
    assert max(loads) - min(loads) <= max(sizes.values())  # greedy: within one tensor
    assert rank_partition(sizes, 3) == parts  # every rank computes the same split
    with pytest.raises(ValueError, match="world"):
        rank_partition(sizes, 0)


def test_two_ranks_publish_their_parts_and_engines_reassemble(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(_free_port()), str(WORKER), str(tmp_path), str(store),
    ]  # fmt: skip
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "true",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HOME": str(tmp_path / "hf"),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (
        f"accelerate launch failed ({proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-4000:]}"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    states = ranks[0]["states"]
    names = [set(r["names"]) for r in ranks]
    assert names[0] and names[1] and not names[0] & names[1]
    assert names[0] | names[1] == set(states[0])
    sub = Subscriber(LocalStore(store))
    manifest = sub.manifest(3)
    assert [p.name for p in manifest.parts] == ["rank0", "rank1"]
    assert [{t.name for t in p.tensors} for p in manifest.parts] == names
    assert not weights_equal(states[3], states[0])  # the steps moved the weights
    engine = {k: v.numpy().copy() for k, v in states[0].items()}
    sub.version = 0
    for version in (1, 2, 3):  # an engine following the stream (version 2 is an anchor)
        assert sub.pull(engine, version=version).version == version
        got = {k: torch.from_numpy(v) for k, v in engine.items()}
        assert weights_equal(got, states[version]), version
    fresh = {k: torch.from_numpy(v) for k, v in Subscriber(LocalStore(store)).materialize().items()}
    assert weights_equal(fresh, states[3])
