"""`policy_loss` against a naive loop reference written from the papers' objectives.

The reference builds the loss scalar-by-scalar in float64 with plain Python loops over
sequences and tokens (GRPO/PPO clip, DAPO clip-higher, dual clip, GSPO sequence ratio,
the four aggregations, KL in the loss, entropy bonus, IS weights) and autograd gives its
gradient, so both values and gradients are compared.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.grpo import GRPOConfig, GRPOError, LossNormalizer, policy_loss

B, T = 6, 8
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]


def random_inputs(seed: int, gap: float = 0.3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    return {
        "logp": logp,
        "old": logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * gap,
        "ref": logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * gap,
        "adv": torch.randn(B, generator=gen, dtype=torch.float64),
        "isw": torch.rand(B, T, generator=gen, dtype=torch.float64) * 2,
        "ent": torch.rand(B, T, generator=gen, dtype=torch.float64),
        "mask": _mask(gen),
    }


def _mask(gen: torch.Generator) -> torch.Tensor:
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[0] = False  # an empty (fully masked) response
    mask[1] = False
    mask[1, 3] = True  # a one-token response
    return mask


def clip(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return torch.clamp(x, lo, hi)


def naive_loss(
    inp: dict[str, torch.Tensor],
    logp: torch.Tensor,
    cfg: GRPOConfig,
    use_ref: bool,
    use_is: bool,
    use_ent: bool,
) -> torch.Tensor:
    mask, old, adv = inp["mask"], inp["old"], inp["adv"]
    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    seq_losses, seq_lens, token_losses = [], [], []
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        a = adv[i].item()
        if cfg.ratio_level == "sequence" and idx:
            # GSPO: s_i = (prod_t pi/pi_old)^(1/|y_i|); GSPO-token keeps s_i's value on every
            # token and routes the gradient of log pi(y_t) through it: s_it = sg[s_i] pi_t/sg[pi_t]
            s_val = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in idx) / len(idx))
        per_tok = []
        for t in idx:
            if cfg.ratio_level == "token":
                r = torch.exp(logp[i, t] - old[i, t])
            else:
                r = s_val * torch.exp(logp[i, t] - logp[i, t].detach())
            term = torch.maximum(-a * r, -a * clip(r, lo, hi))
            if cfg.dual_clip is not None and a < 0:
                term = torch.minimum(term, torch.tensor(-a * cfg.dual_clip, dtype=term.dtype))
            if use_is:
                term = term * inp["isw"][i, t]
            if use_ref:
                log_r = inp["ref"][i, t] - logp[i, t]
                kl = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.exp(log_r) - 1 - log_r}[
                    cfg.kl_estimator
                ]
                term = term + cfg.kl_coef * kl
            if use_ent:
                term = term - cfg.entropy_coef * inp["ent"][i, t]
            per_tok.append(term)
            token_losses.append(term)
        seq_losses.append(per_tok)
        seq_lens.append(len(idx))
    zero = torch.zeros((), dtype=torch.float64)
    nonempty = [s for s in seq_losses if s]
    if cfg.loss_agg == "token-mean":
        return sum(token_losses, zero) / len(token_losses)
    if cfg.loss_agg == "seq-mean-token-mean":
        return sum((sum(s, zero) / len(s) for s in nonempty), zero) / len(nonempty)
    if cfg.loss_agg == "seq-mean-token-sum":
        return sum((sum(s, zero) for s in nonempty), zero) / len(nonempty)
    return sum((sum(s, zero) / cfg.max_tokens for s in seq_losses), zero) / B  # Dr. GRPO


def compare(
    cfg: GRPOConfig,
    seed: int,
    use_ref: bool = False,
    use_is: bool = False,
    use_ent: bool = False,
    gap: float = 0.3,
) -> dict[str, torch.Tensor]:
    inp = random_inputs(seed, gap)
    logp = inp["logp"].clone().requires_grad_()
    loss, metrics = policy_loss(
        logp,
        inp["old"],
        inp["adv"],
        inp["mask"],
        config=cfg,
        ref_logprobs=inp["ref"] if use_ref else None,
        is_weights=inp["isw"] if use_is else None,
        entropy=inp["ent"] if use_ent else None,
    )
    loss.backward()
    ref_logp = inp["logp"].clone().requires_grad_()
    want = naive_loss(inp, ref_logp, cfg, use_ref, use_is, use_ent)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-9, atol=1e-12)
    return metrics


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_clipped_surrogate_matches_naive(agg: str, ratio_level: str) -> None:
    cfg = GRPOConfig(
        loss_agg=agg,
        ratio_level=ratio_level,
        max_tokens=T,  # type: ignore[arg-type]
        clip_eps_low=0.1,
        clip_eps_high=0.1,
    )
    metrics = compare(cfg, seed=0)
    assert metrics["clip_frac"].item() > 0  # the test exercises clipping


@pytest.mark.parametrize("agg", AGGS)
def test_dapo_clip_higher_matches_naive(agg: str) -> None:
    cfg = GRPOConfig(loss_agg=agg, clip_eps_low=0.2, clip_eps_high=0.28, max_tokens=T)  # type: ignore[arg-type]
    metrics = compare(cfg, seed=1, gap=0.5)
    assert metrics["clip_frac_high"].item() > 0 and metrics["clip_frac_low"].item() > 0


def test_gspo_paper_objective_matches_naive() -> None:
    cfg = GRPOConfig(
        ratio_level="sequence",
        loss_agg="seq-mean-token-mean",
        clip_eps_low=3e-4,
        clip_eps_high=4e-4,
    )
    compare(cfg, seed=2, gap=0.01)


def test_dual_clip_matches_naive() -> None:
    cfg = GRPOConfig(loss_agg="token-mean", dual_clip=1.5, clip_eps_low=0.2)
    metrics = compare(cfg, seed=3, gap=1.0)
    assert metrics["dual_clip_frac"].item() > 0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_loss_matches_naive(estimator: str) -> None:
    cfg = GRPOConfig(loss_agg="token-mean", kl_coef=0.3, kl_estimator=estimator)  # type: ignore[arg-type]
    compare(cfg, seed=4, use_ref=True)


def test_is_weights_and_entropy_bonus_match_naive() -> None:
    cfg = GRPOConfig(loss_agg="seq-mean-token-sum", entropy_coef=0.05)
    compare(cfg, seed=5, use_is=True, use_ent=True)


def test_global_normalizer_makes_microbatch_losses_add_up() -> None:
    inp = random_inputs(6)
    for agg in AGGS:
        cfg = GRPOConfig(loss_agg=agg, max_tokens=T)  # type: ignore[arg-type]
        full, _ = policy_loss(inp["logp"], inp["old"], inp["adv"], inp["mask"], config=cfg)
        norm = LossNormalizer.from_mask(inp["mask"])
        parts = [
            policy_loss(
                inp["logp"][s],
                inp["old"][s],
                inp["adv"][s],
                inp["mask"][s],
                config=cfg,
                normalizer=norm,
            )[0]
            for s in (slice(0, 1), slice(1, 4), slice(4, B))
        ]
        assert sum(p.item() for p in parts) == pytest.approx(full.item(), rel=1e-12)


def test_zero_advantage_gives_zero_policy_gradient() -> None:
    inp = random_inputs(7)
    logp = inp["logp"].clone().requires_grad_()
    loss, _ = policy_loss(
        logp, inp["old"], torch.zeros(B, dtype=torch.float64), inp["mask"], config=GRPOConfig()
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logp.grad) == 0


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("agg", AGGS)
def test_extreme_inputs_stay_finite(ratio_level: str, agg: str) -> None:
    """+-80 log-prob gaps, -inf log-probs, NaN padding, empty rows: finite loss and grads."""
    logp = torch.full((4, 5), -1.0)
    old = torch.full((4, 5), -1.0)
    ref = torch.full((4, 5), -1.0)
    logp[0, 1], old[0, 1] = 79.0, -1.0
    logp[0, 2], old[0, 2] = -81.0, -1.0
    logp[1, 1] = float("-inf")
    old[1, 2] = float("-inf")
    logp[1, 3] = old[1, 3] = ref[1, 3] = float("-inf")
    ref[2, 1] = float("-inf")
    logp[2, 4] = float("nan")  # garbage in a padding position
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[:, 0] = False
    mask[2, 4] = False
    mask[3] = False  # empty response
    logp = logp.requires_grad_()
    cfg = GRPOConfig(
        ratio_level=ratio_level,
        loss_agg=agg,
        kl_coef=0.1,
        kl_estimator="k3",  # type: ignore[arg-type]
        dual_clip=3.0,
    )
    loss, metrics = policy_loss(
        logp, old, torch.tensor([1.0, -1.0, 0.5, 2.0]), mask, config=cfg, ref_logprobs=ref
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    assert logp.grad[1, 1].item() == 0.0  # -inf log-prob: finite value, no gradient
    assert logp.grad[1, 3].item() == 0.0
    assert logp.grad[3].abs().sum().item() == 0.0  # empty response contributes nothing


def test_missing_inputs_raise_clear_errors() -> None:
    inp = random_inputs(8)
    with pytest.raises(GRPOError, match="ref_logprobs"):
        policy_loss(
            inp["logp"], inp["old"], inp["adv"], inp["mask"], config=GRPOConfig(kl_coef=0.1)
        )
    with pytest.raises(GRPOError, match="entropy"):
        policy_loss(
            inp["logp"], inp["old"], inp["adv"], inp["mask"], config=GRPOConfig(entropy_coef=0.1)
        )
    with pytest.raises(GRPOError, match="advantages"):
        policy_loss(inp["logp"], inp["old"], torch.zeros(B + 1), inp["mask"], config=GRPOConfig())
    with pytest.raises(GRPOError, match="clip_eps_low"):
        GRPOConfig(clip_eps_low=1.5)


@pytest.mark.parametrize("agg", AGGS)
def test_forward_kl_from_the_hook_enters_the_loss_as_given(agg: str) -> None:
    """With ``kl_estimator='forward'`` the per-token KL the hook computed is added as it is,
    kl_coef times it on every loss token (masked positions ignored), with its gradient; the
    sampled log-probs of a reference are not used."""
    inp = random_inputs(9)
    gen = torch.Generator().manual_seed(10)
    kl_in = torch.rand(B, T, generator=gen, dtype=torch.float64)
    kl_in[~inp["mask"]] = float("nan")  # garbage where the mask is off
    cfg = GRPOConfig(loss_agg=agg, kl_coef=0.3, kl_estimator="forward", max_tokens=T)  # type: ignore[arg-type]
    plain = GRPOConfig(loss_agg=agg, max_tokens=T)  # type: ignore[arg-type]
    kl = kl_in.clone().requires_grad_()
    loss, metrics = policy_loss(inp["logp"], inp["old"], inp["adv"], inp["mask"], config=cfg, kl=kl)
    loss.backward()
    without, _ = policy_loss(inp["logp"], inp["old"], inp["adv"], inp["mask"], config=plain)
    # the KL term alone, aggregated as the policy term is, from a loop over the tokens
    mask = inp["mask"]
    terms = [[kl_in[i, t].item() for t in range(T) if mask[i, t]] for i in range(B)]
    tokens = [x for row in terms for x in row]
    rows = [row for row in terms if row]
    kl_term = {
        "token-mean": sum(tokens) / len(tokens),
        "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows) / len(rows),
        "seq-mean-token-sum": sum(sum(r) for r in rows) / len(rows),
        "constant": sum(sum(r) / T for r in terms) / B,
    }[agg]
    assert loss.item() == pytest.approx(without.item() + 0.3 * kl_term, rel=1e-9)
    assert metrics["kl"].item() == pytest.approx(sum(tokens) / len(tokens), rel=1e-9)
    assert torch.isfinite(kl.grad).all()
    assert (kl.grad[~mask] == 0).all() and (kl.grad[mask] > 0).all()


def test_forward_kl_needs_the_hooks_kl_and_loss_placement() -> None:
    inp = random_inputs(11)
    cfg = GRPOConfig(kl_coef=0.1, kl_estimator="forward")
    with pytest.raises(GRPOError, match=r"ForwardOutput\.kl"):
        policy_loss(
            inp["logp"], inp["old"], inp["adv"], inp["mask"], config=cfg, ref_logprobs=inp["ref"]
        )
    with pytest.raises(GRPOError, match="kl_placement"):
        GRPOConfig(kl_coef=0.1, kl_estimator="forward", kl_placement="reward")
