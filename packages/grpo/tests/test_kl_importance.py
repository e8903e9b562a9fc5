"""KL estimators and importance weights against naive per-token loops (Schulman 2020; TIS/MIS)."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.grpo import (
    GRPOError,
    forward_kl,
    importance_weights,
    kl_estimate,
    kl_penalized_rewards,
)

B, T = 5, 9


def random_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    other = logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[0] = False  # one empty row
    mask[1] = False
    mask[1, 4] = True  # one single-token row
    return logp, other.clamp(max=0), mask


def naive_kl(logp: float, ref: float, estimator: str) -> float:
    log_r = ref - logp  # r = pi_ref / pi for a sample from pi
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return (math.exp(log_r) - 1) - log_r


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_values_and_gradients_match_naive(estimator: str) -> None:
    logp, ref, mask = random_batch(0)
    logp = logp.requires_grad_()
    got = kl_estimate(logp, ref, mask, estimator)
    got.sum().backward()
    naive_grad = torch.zeros_like(logp)
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                assert got[i, t].item() == 0.0
                continue
            want = naive_kl(logp[i, t].item(), ref[i, t].item(), estimator)
            assert got[i, t].item() == pytest.approx(want, rel=1e-10, abs=1e-12)
            # derivative of the estimator w.r.t. log pi, from the formula
            x = logp[i, t].item() - ref[i, t].item()  # = -log r
            naive_grad[i, t] = {"k1": 1.0, "k2": x, "k3": 1 - math.exp(-x)}[estimator]
    torch.testing.assert_close(logp.grad, naive_grad, rtol=1e-10, atol=1e-12)


def test_k1_and_k3_are_unbiased_kl_on_samples() -> None:
    """Independent check: the mean of k1/k3 over samples from p approaches KL(p || q)."""
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(8, generator=gen, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(8, generator=gen, dtype=torch.float64), 0)
    exact = (p * (p / q).log()).sum().item()
    x = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    logp, logq = p.log()[x][None], q.log()[x][None]
    mask = torch.ones_like(logp, dtype=torch.bool)
    for est in ("k1", "k3"):
        assert kl_estimate(logp, logq, mask, est).mean().item() == pytest.approx(exact, abs=4e-3)


def test_kl_in_reward_subtracts_sequence_sum() -> None:
    logp, ref, mask = random_batch(1)
    rewards = torch.arange(B, dtype=torch.float64)
    got = kl_penalized_rewards(rewards, logp, ref, mask, coef=0.1, estimator="k3")
    for i in range(B):
        total = sum(
            naive_kl(logp[i, t].item(), ref[i, t].item(), "k3") for t in range(T) if mask[i, t]
        )
        assert got[i].item() == pytest.approx(i - 0.1 * total, rel=1e-10, abs=1e-12)


def naive_weights(
    trainer: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
    lower: float,
) -> list[list[float]]:
    out = []
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        rho = {t: math.exp(trainer[i, t].item() - rollout[i, t].item()) for t in idx}
        row = [0.0] * T
        if mode == "none":
            for t in idx:
                row[t] = 1.0
        elif mode == "token_tis":
            for t in idx:
                row[t] = min(rho[t], cap)
        elif mode == "token_mis":
            for t in idx:
                row[t] = rho[t] if lower <= rho[t] <= cap else 0.0
        elif mode == "sequence_mis":
            prod = 1.0
            for t in idx:
                prod *= rho[t]
            for t in idx:
                row[t] = prod if lower <= prod <= cap else 0.0
        else:  # geometric_mis: accept/reject on the geometric mean
            prod = 1.0
            for t in idx:
                prod *= rho[t]
            geo = prod ** (1 / len(idx)) if idx else 1.0
            for t in idx:
                row[t] = 1.0 if lower <= geo <= cap else 0.0
        out.append(row)
    return out


@pytest.mark.parametrize(
    ("mode", "cap", "lower"),
    [
        ("none", 2.0, None),
        ("token_tis", 1.3, None),
        ("token_mis", 1.3, 0.8),
        ("sequence_mis", 1.5, 0.5),
        ("geometric_mis", 1.1, None),
    ],
)
def test_importance_weights_match_naive(mode: str, cap: float, lower: float | None) -> None:
    trainer, rollout, mask = random_batch(2)
    weights, metrics = importance_weights(trainer, rollout, mask, mode, cap, lower)
    lo = lower if lower is not None else (1 / cap if mode == "geometric_mis" else 0.0)
    want = torch.tensor(naive_weights(trainer, rollout, mask, mode, cap, lo), dtype=torch.float64)
    torch.testing.assert_close(weights.double(), want, rtol=1e-9, atol=1e-12)
    w = [want[i, t].item() for i in range(B) for t in range(T) if mask[i, t]]
    assert metrics["is_weight_mean"].item() == pytest.approx(sum(w) / len(w))
    assert metrics["is_weight_max"].item() == pytest.approx(max(w))
    ess = sum(w) ** 2 / (len(w) * sum(x * x for x in w)) if any(w) else 0.0
    assert metrics["is_ess"].item() == pytest.approx(ess)
    assert not weights.requires_grad


def test_importance_weight_modes_actually_differ() -> None:
    trainer, rollout, mask = random_batch(4)
    rows = {
        m: importance_weights(trainer, rollout, mask, m, 1.2)[0]
        for m in ("token_tis", "token_mis", "sequence_mis", "geometric_mis")
    }
    assert rows["token_tis"].max().item() == pytest.approx(1.2)
    assert (rows["token_mis"] == 0).logical_and(mask).any()
    assert not torch.equal(rows["sequence_mis"], rows["geometric_mis"])


@pytest.mark.parametrize("mode", ["token_tis", "token_mis", "sequence_mis", "geometric_mis"])
def test_extreme_gaps_and_inf_give_finite_weights(mode: str) -> None:
    trainer = torch.full((4, 3), -1.0)
    rollout = torch.full((4, 3), -1.0)
    trainer[0, 1], rollout[0, 1] = 79.0, -1.0  # +80 gap: trainer far more likely
    trainer[1, 1], rollout[1, 1] = -81.0, -1.0  # -80 gap
    trainer[2, 1] = float("-inf")  # trainer says impossible
    rollout[3, 1] = float("-inf")  # engine reported -inf
    trainer[3, 2] = rollout[3, 2] = float("-inf")  # both -inf: ratio defined as 1
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[:, 0] = False
    weights, metrics = importance_weights(trainer, rollout, mask, mode, 2.0)
    assert torch.isfinite(weights).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())
    assert weights.max().item() <= 2.0
    if mode == "token_tis":
        assert weights[0, 1].item() == 2.0 and weights[3, 1].item() == 2.0  # truncated at cap
        assert weights[1, 1].item() < 1e-8 and weights[2, 1].item() < 1e-8
        assert weights[3, 2].item() == 1.0
    if mode in ("token_mis", "sequence_mis"):
        assert weights[0, 1].item() == 0.0  # masked, never inf


def test_unknown_mode_and_shape_mismatch_raise() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(GRPOError, match="unknown importance"):
        importance_weights(x, x, x.bool(), "bogus")  # type: ignore[arg-type]
    with pytest.raises(GRPOError, match="shape"):
        importance_weights(x, torch.zeros(2, 4), x.bool())


def test_forward_kl_and_its_gradient_match_a_loop_over_the_vocabulary() -> None:
    """KL(pi_ref || pi) = sum_v pi_ref(v) log(pi_ref(v) / pi(v)) per position, from plain
    Python sums; its gradient w.r.t. the policy's logits is pi - pi_ref."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 7, generator=gen, dtype=torch.float64).requires_grad_()
    ref_logits = torch.randn(3, 4, 7, generator=gen, dtype=torch.float64)
    got = forward_kl(logits, ref_logits)
    assert got.shape == (3, 4)
    got.sum().backward()
    for i in range(3):
        for t in range(4):
            z = [math.exp(x) for x in logits[i, t].tolist()]
            zr = [math.exp(x) for x in ref_logits[i, t].tolist()]
            p = [x / sum(z) for x in z]
            q = [x / sum(zr) for x in zr]
            want = sum(qv * math.log(qv / pv) for pv, qv in zip(p, q, strict=True))
            assert got[i, t].item() == pytest.approx(want, rel=1e-10, abs=1e-12)
            grad = [pv - qv for pv, qv in zip(p, q, strict=True)]
            assert logits.grad[i, t].tolist() == pytest.approx(grad, rel=1e-9, abs=1e-12)


def test_forward_kl_is_zero_against_itself_and_charges_a_dropped_token() -> None:
    """The same logits give exactly 0. A policy that moved all of a token's probability to
    another pays log(1 / its share) in the forward KL, while the sampled estimators, which
    see only the token it now samples, charge it far less."""
    logits = torch.tensor([[0.0, 0.0]])
    assert forward_kl(logits, logits).item() == 0.0
    collapsed = torch.tensor([[0.0, -30.0]])  # the reference's second token, dropped
    exact = forward_kl(collapsed, logits).item()
    assert exact > 10.0  # 0.5 * (log 0.5 - log ~1e-13)
    sampled = kl_estimate(
        torch.tensor([[0.0]]), torch.tensor([[math.log(0.5)]]), torch.tensor([[True]]), "k2"
    ).item()
    assert sampled == pytest.approx(0.5 * math.log(2) ** 2)
    assert sampled < exact / 20
