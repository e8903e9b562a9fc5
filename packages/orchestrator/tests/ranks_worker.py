"""Worker for the per-rank publishing test, run under ``accelerate launch`` (2 processes).

Every process builds the same seeded policy, takes data-parallel SGD steps (gloo on the CPU)
on next-token loss over its own token stream, and publishes each version through
`WeightPublisher(rank=, world=)`: only its own partition of the tensors. Process 0 saves
its whole state per version, and every process the names it published, to ``argv[1]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# run as a script, so this directory is on sys.path: the tests' tiny policy config
from conftest import TINY, TINY_SEED
from tandem.delta_sync import LocalStore
from tandem.orchestrator.inference.tokenizer import ByteTokenizer
from tandem.orchestrator.policy import build_model
from tandem.orchestrator.training.weights import WeightPublisher, state_for_sync


def main(out_dir: str, store_dir: str) -> None:
    from accelerate import Accelerator, DistributedDataParallelKwargs

    # experts a rank's tokens do not reach get no gradient there
    kwargs = DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[kwargs])
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    policy = build_model(TINY, ByteTokenizer(), seed=TINY_SEED)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(policy, optimizer)
    publisher = WeightPublisher(
        LocalStore(store_dir),
        accelerator.unwrap_model(model),
        anchor_every=2,
        rank=rank,
        world=world,
    )
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    saved = {}
    for version in range(4):
        if version:
            tokens = torch.randint(0, 256, (64,), generator=gen)
            logits = model(tokens, cu_seqlens=[0, 64]).logits
            loss = F.cross_entropy(logits[:-1].float(), tokens[1:])
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
        publisher.publish(version)
        saved[version] = {k: v.clone() for k, v in state_for_sync(policy).items()}
    assert set(publisher.publisher._prev) == publisher.names  # never held the other part
    torch.save(
        {"names": sorted(publisher.names or ()), "states": saved if rank == 0 else None},
        Path(out_dir) / f"rank{rank}.pt",
    )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
