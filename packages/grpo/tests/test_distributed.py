"""The 2-process (gloo, CPU) update equals the 1-process update on the same global batch,
and bit for bit the 1-process update that accumulates as two processes (``shards=2``), both
with DDP and with FSDP (parameters sharded by torch's `fully_shard`; one process then also
computes the clipping norm in the shard layout). The batch's rows split unevenly over the
processes, so under FSDP one rank pads its micro-batches, and the clipping engages.

The worker is started with ``accelerate launch --multi_gpu --num_processes 2`` and creates
``Accelerator(cpu=True)``: accelerate's launcher spawns the processes (torchrun) and the CPU
accelerator joins them with gloo. (``accelerate launch --cpu --num_processes 2`` only spawns
several processes through MPI with a hostfile; without one it runs a single process.)
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from accelerate import Accelerator

from tandem.grpo import GRPOStep

WORKER = Path(__file__).with_name("dist_worker.py")


def load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_dist_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_equal_one_process(tmp_path: Path, parallel: str) -> None:
    worker = load_worker()
    model, batch = worker.build(worker.load_tiny())
    trainer = GRPOStep(
        model, torch.optim.SGD(model.parameters(), lr=0.5), worker.CONFIG, Accelerator(cpu=True)
    )
    single = trainer.step(batch)
    before = worker.build(worker.load_tiny())[0].state_dict()
    # one process accumulating as two would (`shards=2`) must give the 2-process bits
    sharded_model, _ = worker.build(worker.load_tiny())
    sharded = GRPOStep(
        sharded_model,
        torch.optim.SGD(sharded_model.parameters(), lr=0.5),
        worker.CONFIG,
        Accelerator(cpu=True),
        fsdp=parallel == "fsdp",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in each of the two processes: CPU kernels split by threads
    try:
        sharded_metrics = sharded.step(batch, shards=2)
    finally:
        torch.set_num_threads(threads)

    out = tmp_path / "two.pt"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(free_port()),
        str(WORKER),
        str(out),
        parallel,
    ]
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "true",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HOME": str(tmp_path / "hf"),
    }  # no user accelerate config is picked up
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, (
        f"accelerate launch failed ({proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-4000:]}"
    )
    two = torch.load(out)
    assert 0 < two["rows"] < batch.num_sequences  # process 0 really had only part of it
    for name, value in model.state_dict().items():
        assert not torch.equal(value, before[name]) or "bias" in name  # the step moved weights
        torch.testing.assert_close(two["params"][name], value, rtol=1e-5, atol=1e-6)
        assert torch.equal(two["params"][name], sharded_model.state_dict()[name]), name
    assert sharded_metrics["grad_norm"] == two["metrics"]["grad_norm"]
    for key in (
        "loss",
        "pg_loss",
        "kl",
        "grad_norm",
        "tokens",
        "groups_kept",
        "is_weight_mean",
        "clip_frac",
        "mismatch_k3",
        "ratio_max",
    ):
        assert two["metrics"][key] == pytest_approx(single[key]), key
    assert single["groups_kept"] == 9 and single["groups"] == 10
    assert single["grad_norm"] > worker.CONFIG.max_grad_norm  # the clipping engaged


def pytest_approx(x: float):
    return pytest.approx(x, rel=1e-5, abs=1e-7)
