"""Worker for the 1-vs-2-process equality test, run under ``accelerate launch``.

Every process builds the same seeded model and global batch, trains on its share of whole
groups, and process 0 saves the updated parameters and the metrics to ``argv[1]``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from tandem.grpo import GRPOConfig, GRPOStep, RolloutBatch, shard_by_group

CONFIG = GRPOConfig(loss_agg="token-mean", micro_batch_size=3, kl_coef=0.05, max_grad_norm=0.02)


def load_tiny() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "grpo_tiny_policy", Path(__file__).with_name("tiny_policy.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(tiny: ModuleType) -> tuple[torch.nn.Module, RolloutBatch]:
    """The seeded model and a global batch of 10 groups (one all-equal group is skipped)."""
    torch.manual_seed(0)
    model = tiny.TinyPolicy()
    gen = torch.Generator().manual_seed(1)
    batch = tiny.sample_reverse_task(model, 10, 4, gen)
    batch.rewards = torch.rand(40, generator=gen).round(decimals=1)
    batch.rewards[:4] = 0.5  # an all-equal group: skipped by dynamic sampling
    batch.ref_logprobs = batch.rollout_logprobs + 0.1 * torch.randn(40, tiny.LENGTH, generator=gen)
    batch.rollout_logprobs = batch.rollout_logprobs + 0.05 * torch.randn(
        40, tiny.LENGTH, generator=gen
    )
    return model, batch


def main(out: str, parallel: str) -> None:
    """``parallel``: ``ddp`` (accelerate wraps the model) or ``fsdp`` (torch's `fully_shard`
    over the group accelerate joined; only the optimizer goes through accelerate)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, batch = build(load_tiny())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    fsdp = parallel == "fsdp"
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        optimizer = accelerator.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    trainer = GRPOStep(model, optimizer, CONFIG, accelerator, fsdp=fsdp)
    local = shard_by_group(batch, accelerator.process_index, accelerator.num_processes)
    metrics = trainer.step(local)
    state = accelerator.unwrap_model(model).state_dict()
    # every rank joins the gathers of the sharded parameters
    params = {k: (v.full_tensor() if fsdp else v).detach().clone() for k, v in state.items()}
    if accelerator.is_main_process:
        torch.save({"params": params, "metrics": metrics, "rows": local.num_sequences}, out)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # End here, without the interpreter's teardown. Under FSDP, DTensor's global caches
    # (sharding propagation, redistribute plans) keep the device mesh, and through it the
    # gloo process group, alive after `destroy_process_group`: its worker threads
    # (`pt_gloo_runloop`, `gloo_tcp_loop`) are still running when the interpreter finalizes,
    # and one touching a Python-owned tensor then aborts the process ("terminate called
    # without an active exception", SIGABRT). Everything this process owes is done: the
    # result is written and every rank has left the group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
