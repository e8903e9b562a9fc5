"""The shard-layout gradient norm: equal to the plain L2 norm (float64 reference) up to
rounding, independent of how many shards only through rounding, and clipping scales every
gradient by one factor."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.grpo.sharded_norm import clip_sharded_grads, sharded_grad_norm


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (3,), (1, 4), (64, 33)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: counts as zero
    return params


def _reference(params: list[torch.nn.Parameter]) -> float:
    return math.sqrt(
        sum(float(p.grad.double().square().sum()) for p in params if p.grad is not None)
    )


@pytest.mark.parametrize("shards", [1, 2, 3, 8])
def test_norm_matches_a_float64_reference(shards: int) -> None:
    params = _params()
    got = float(sharded_grad_norm(params, shards))
    assert got == pytest.approx(_reference(params), rel=1e-6)


def test_two_shards_add_each_parameters_halves() -> None:
    params = _params(1)
    want = (
        torch.stack(
            [
                torch.chunk(p.grad, 2)[0].float().square().sum()
                + (torch.chunk(p.grad, 2)[1].float().square().sum() if p.grad.shape[0] > 1 else 0)
                if p.grad is not None
                else torch.zeros(())
                for p in params
            ]
        )
        .sum()
        .sqrt()
    )
    assert torch.equal(sharded_grad_norm(params, 2), want)


def test_clipping_scales_all_gradients_to_the_limit() -> None:
    params = [p for p in _params(2) if p.grad is not None]
    before = [p.grad.clone() for p in params]
    norm = clip_sharded_grads(params, 1.0, shards=2)
    assert norm == pytest.approx(_reference([_with_grad(b) for b in before]), rel=1e-6)
    assert norm > 1.0
    assert float(sharded_grad_norm(params, 2)) == pytest.approx(1.0, rel=1e-5)
    factors = torch.cat([(p.grad / b).flatten() for p, b in zip(params, before, strict=True)])
    assert torch.allclose(factors, factors[0].expand_as(factors))  # one factor for all
    assert float(factors[0]) == pytest.approx(1.0 / norm, rel=1e-5)


def test_small_gradients_are_left_as_they_are_and_bad_shards_refused() -> None:
    params = [p for p in _params(3) if p.grad is not None]
    before = [p.grad.clone() for p in params]
    clip_sharded_grads(params, 1e9, shards=2)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))
    with pytest.raises(ValueError, match="shards must be >= 1"):
        sharded_grad_norm(params, 0)


def _with_grad(grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    return p
