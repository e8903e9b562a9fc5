"""Routed expert products without padding, against a reference that runs every (token, slot)
alone through its expert's SwiGLU.

Under `batch_invariant()` a row's product does not depend on the other rows, so the
segment-by-segment products must give the lone rows' bits exactly, on skewed routings (one
expert taking most slots, experts with no rows, segments that do not fill a row tile) and at
1 and 2 threads. With torch's own kernels they must agree within float rounding, and the
gradients of the stacked expert weights and of the input must match the reference's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.moe_determinism import batch_invariant
from tandem.moe_determinism.model.experts import routed_experts

EXPERTS, HIDDEN, FFN = 6, 48, 80


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(EXPERTS, FFN, HIDDEN, generator=g) * 0.2).requires_grad_(),
        (torch.randn(EXPERTS, FFN, HIDDEN, generator=g) * 0.2).requires_grad_(),
        (torch.randn(EXPERTS, HIDDEN, FFN, generator=g) * 0.2).requires_grad_(),
    )


def _skewed_ids(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Ascending distinct ids per token, most tokens reaching expert 1; expert 4 never used."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.tensor([1.0, 12.0, 2.0, 1.0, 0.0, 0.5])
    ids = torch.stack([torch.multinomial(weights, k, generator=g) for _ in range(tokens)])
    return ids.sort(-1).values


def _reference(x, ids, gate, up, down) -> torch.Tensor:
    """Each (token, slot) through its expert on its own: one row per product."""
    rows = []
    for t in range(ids.shape[0]):
        for e in ids[t].tolist():
            row = x[t : t + 1]
            rows.append(F.linear(F.silu(F.linear(row, gate[e])) * F.linear(row, up[e]), down[e]))
    return torch.cat(rows).view(ids.shape[0], ids.shape[1], -1)


@pytest.mark.parametrize("tokens,k", [(1, 1), (7, 2), (45, 2), (70, 3)])
def test_invariant_products_equal_lone_rows_bit_for_bit(tokens: int, k: int, threads: int) -> None:
    gate, up, down = _weights(tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(k))
    ids = _skewed_ids(tokens, k, tokens + k)
    with torch.no_grad(), batch_invariant():
        got = routed_experts(x, ids, gate, up, down)
        want = _reference(x, ids, gate, up, down)
    assert got.shape == (tokens, k, HIDDEN)
    assert torch.equal(got, want)


def test_invariant_rows_do_not_depend_on_the_batch(threads: int) -> None:
    """A token's slots give the same bits alone, in a prefix of the batch, or in the batch."""
    gate, up, down = _weights(3)
    x = torch.randn(53, HIDDEN, generator=torch.Generator().manual_seed(5))
    ids = _skewed_ids(53, 2, 9)
    with torch.no_grad(), batch_invariant():
        whole = routed_experts(x, ids, gate, up, down)
        for m in (1, 16, 17, 40):
            assert torch.equal(routed_experts(x[:m], ids[:m], gate, up, down), whole[:m])


@pytest.mark.parametrize("invariant", [False, True], ids=["stock", "invariant"])
def test_values_and_gradients_match_the_reference(invariant: bool) -> None:
    gate, up, down = _weights(11)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(2)).requires_grad_()
    ids = _skewed_ids(37, 2, 4)
    seed = torch.randn(37, 2, HIDDEN, generator=torch.Generator().manual_seed(8))
    with batch_invariant(invariant):
        got = routed_experts(x, ids, gate, up, down)
        grads = torch.autograd.grad((got * seed).sum(), (x, gate, up, down))
    want = _reference(x, ids, gate, up, down)
    ref_grads = torch.autograd.grad((want * seed).sum(), (x, gate, up, down))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("x", "gate", "up", "down"), grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")
    # an expert no token reached gets an exact zero gradient
    assert not (grads[1][4].any() or grads[2][4].any() or grads[3][4].any())


def test_no_tokens_gives_an_empty_result() -> None:
    gate, up, down = _weights(0)
    out = routed_experts(
        torch.empty(0, HIDDEN), torch.empty(0, 2, dtype=torch.long), gate, up, down
    )
    assert out.shape == (0, 2, HIDDEN)
