"""The split attention's sum over KV splits without its dense grid: `prefix_tree_sum` against
the zero-filled grid and `tree_sum` it replaces, bit for bit (signed zeros included)."""

from __future__ import annotations

import pytest
import torch

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.ops import split_grid
from tandem.moe_determinism.ops.reduction import tree_sum
from tandem.moe_determinism.ops.split_grid import SplitTreeSum, prefix_tree_sum


@pytest.fixture(params=["by length", "by depth"])
def grouping(request, monkeypatch) -> list[int]:
    """Both ways `prefix_tree_sum` groups its blocks: by prefix length (a group's calls
    priced at nothing) and by tree depth, zero-padded (the calls priced above any padding).
    Returns the widths of the sums it makes, for the test to check which way it went."""
    monkeypatch.setattr(split_grid, "CALL_ELEMENTS", 0 if request.param == "by length" else 1 << 60)
    widths: list[int] = []

    def recording(leaves: torch.Tensor, dim: int) -> torch.Tensor:
        widths.append(leaves.shape[dim])
        return tree_sum(leaves, dim)

    monkeypatch.setattr(split_grid, "tree_sum", recording)
    widths.append(-1 if request.param == "by length" else -2)  # the first entry names the way
    return widths


def _went(widths: list[int], prefix: list[int]) -> None:
    """The sums were made the way the `grouping` fixture asked for."""
    lengths = sorted({a for a in prefix if a})
    powers = sorted({1 << max(0, a - 1).bit_length() for a in lengths})
    # by depth only where it makes fewer groups than by length
    want = lengths if widths[0] == -1 or len(powers) == len(lengths) else powers
    assert sorted(widths[1:]) == want


def _dense(values: torch.Tensor, pair: torch.Tensor, blocks: int, n_sp: int) -> torch.Tensor:
    grid = values.new_zeros(blocks * n_sp, *values.shape[1:])
    grid.index_copy_(0, pair, values)
    return tree_sum(grid.view(blocks, n_sp, *values.shape[1:]), dim=1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # tells -0.0 from +0.0


def _pairs(prefix: list[int], n_sp: int, shuffle: torch.Generator | None) -> torch.Tensor:
    pair = torch.tensor(
        [b * n_sp + s for b, a in enumerate(prefix) for s in range(a)], dtype=torch.long
    )
    if shuffle is not None and pair.numel():
        pair = pair[torch.randperm(pair.numel(), generator=shuffle)]
    return pair


@pytest.mark.parametrize("n_sp", [1, 2, 3, 4, 5, 7, 8, 9, 17])
def test_prefix_sums_have_the_bits_of_the_dense_grid(n_sp: int, grouping: list[int]) -> None:
    gen = torch.Generator().manual_seed(n_sp)
    blocks = 40
    prefix = torch.randint(0, n_sp + 1, (blocks,), generator=gen).tolist()
    prefix[:2] = [0, n_sp]
    pair = _pairs(prefix, n_sp, gen)  # in any order: the in-place path sorts pairs by split
    values = torch.randn(pair.numel(), 3, 5, generator=gen)
    # signed zeros: a whole leaf of -0.0, and -0.0 entries that meet +0.0 or each other
    values[values.abs() < 0.4] = -0.0
    if pair.numel():
        values[0] = -0.0
    got = prefix_tree_sum(values, pair, pair // n_sp, blocks, n_sp)
    assert torch.equal(_bits(got), _bits(_dense(values, pair, blocks, n_sp)))
    _went(grouping, prefix)


def test_blocks_of_negative_zeros_sum_as_in_the_grid(grouping: list[int]) -> None:
    for n_sp in range(1, 10):
        prefix = list(range(0, n_sp + 1))  # a block of every prefix length, in one call
        pair = _pairs(prefix, n_sp, None)
        values = torch.full((pair.numel(), 1), -0.0)
        del grouping[1:]  # this call's sums only
        got = prefix_tree_sum(values, pair, pair // n_sp, len(prefix), n_sp)
        want = _dense(values, pair, len(prefix), n_sp)
        assert torch.equal(_bits(got), _bits(want)), n_sp
        _went(grouping, prefix)


def test_the_autograd_function_gives_each_pair_its_blocks_gradient() -> None:
    n_sp, prefix = 4, [2, 4, 1]
    pair = _pairs(prefix, n_sp, None)
    values = torch.randn(pair.numel(), 2, dtype=torch.float64, requires_grad=True)
    out = SplitTreeSum.apply(values, pair, pair // n_sp, len(prefix), n_sp)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    assert torch.equal(values.grad, weight[pair // n_sp])
    torch.testing.assert_close(out, torch.zeros_like(out).index_add_(0, pair // n_sp, values))


def test_pairs_that_are_not_a_prefix_are_refused(grouping: list[int]) -> None:
    pair = torch.tensor([0, 2])  # block 0 reads splits 0 and 2 of 3
    with pytest.raises(MoEDeterminismError, match="not a prefix"):
        prefix_tree_sum(torch.ones(2, 1), pair, pair // 3, 1, 3)
    # two blocks of one depth (4 and 3 pairs), the second missing split 2
    pair = torch.tensor([0, 1, 2, 3, 4, 5, 7])
    with pytest.raises(MoEDeterminismError, match="not a prefix"):
        prefix_tree_sum(torch.ones(7, 1), pair, pair // 4, 2, 4)
