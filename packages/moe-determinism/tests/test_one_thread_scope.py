"""`stock_ops_on_one_thread`: inside it torch's own ops run on the calling thread alone,
the tile products still share every thread, and nothing outside changes; the model's
layers enter it under `batch_invariant()` on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.moe_determinism import MoEConfig, MoETransformer, batch_invariant
from tandem.moe_determinism.ops import gemm, tiles, workers


def _count_in_new_thread() -> int:
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


@pytest.fixture
def three_threads(monkeypatch: pytest.MonkeyPatch):
    """Three torch threads, every product shared between the workers, and no pool of
    workers yet (the scope starts one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    monkeypatch.setattr(workers, "SHARED_WORK", 0)
    monkeypatch.setattr(workers, "_pools", {})
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_stock_ops_run_alone_while_the_tiles_use_every_thread(
    three_threads, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(70, 600, generator=gen), torch.randn(600, 1100, generator=gen)
    ran_on: set[str] = set()
    one_by_one = tiles._one_by_one

    def recorded(*args: torch.Tensor) -> None:
        ran_on.add(threading.current_thread().name)
        one_by_one(*args)

    monkeypatch.setattr(tiles, "_one_by_one", recorded)
    with workers.stock_ops_on_one_thread():
        assert torch.get_num_threads() == 1  # torch's own ops: this thread alone
        assert workers.tile_threads() == 3
        jobs = tiles.tile_jobs(tiles.row_tiles(a), b.expand(5, 600, 1100), torch.empty(5, 16, 1100))
        assert len(jobs) > 3  # cut for three threads, not for one
        inside = gemm.mm(a, b)
        with workers.stock_ops_on_one_thread():  # nested: no change
            assert torch.get_num_threads() == 1 and workers.tile_threads() == 3
        assert torch.get_num_threads() == 1
    outside = gemm.mm(a, b)
    assert ran_on  # the products went through the tile jobs
    assert ran_on <= {threading.current_thread().name} | {f"tile-worker-{i}" for i in range(2)}
    assert torch.equal(inside, outside)  # who computes a tile, never how
    assert torch.get_num_threads() == 3 and workers.tile_threads() == 3
    assert _count_in_new_thread() == 3  # the pool started inside left torch's count alone


def test_the_counts_come_back_after_an_error(three_threads) -> None:
    with pytest.raises(RuntimeError, match="inside"), workers.stock_ops_on_one_thread():
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 3 and workers.tile_threads() == 3


def test_one_thread_is_left_as_it_is() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with workers.stock_ops_on_one_thread():
            assert torch.get_num_threads() == 1 and workers.tile_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_layers_enter_it_under_batch_invariant_on_the_cpu() -> None:
    """Seen from inside a layer: one thread under `batch_invariant()`, torch's count
    without it; bits of the forward equal those with one thread."""
    cfg = MoEConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    model = MoETransformer(cfg)
    model.reset_parameters(seed=0)
    model.eval()
    seen: list[int] = []
    for layer in model.layers:
        layer.mlp.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.no_grad():
            model(ids)
            assert seen == [2, 2]
            seen.clear()
            with batch_invariant():
                two = model(ids).logits
            assert seen == [1, 1]
            assert torch.get_num_threads() == 2
            torch.set_num_threads(1)
            with batch_invariant():
                one = model(ids).logits
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_a_thread_sets_its_own_count_and_no_other() -> None:
    seen: dict[str, int] = {}

    def own() -> None:
        workers.set_own_thread_count(2)
        seen["own"] = torch.get_num_threads()

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        t = threading.Thread(target=own)
        t.start()
        t.join()
        later = threading.Thread(target=lambda: seen.setdefault("later", torch.get_num_threads()))
        later.start()
        later.join()
        assert seen == {"own": 2, "later": 1} and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="count must be >= 1"):
        workers.set_own_thread_count(0)
