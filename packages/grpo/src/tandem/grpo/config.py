"""`GRPOConfig`: every switch of the loss, the advantages, the corrections and the trainer.

The defaults follow what Composer 2 reported for RL on an agentic coding harness: Dr. GRPO
advantages (group mean baseline, no std normalisation), no length normalisation (the
``constant`` aggregation), a k1 KL estimator, one optimizer step per batch. Importance
correction between the inference engine and the trainer defaults to token-level truncated
IS with cap 2, the default of verl and TRL.
"""

from __future__ import annotations

import math
from typing import Literal, get_args, get_origin, get_type_hints

import msgspec

from tandem.grpo.errors import GRPOError

RatioLevel = Literal["token", "sequence"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]
KLEstimator = Literal["k1", "k2", "k3", "forward"]
KLPlacement = Literal["loss", "reward"]
ISMode = Literal["none", "token_tis", "token_mis", "sequence_mis", "geometric_mis"]


class GRPOConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Configuration of the GRPO-family loss and of `GRPOStep.step`.

    The values are checked when the config is built, by direct construction too (msgspec
    checks types only when decoding): a choice outside its ``Literal`` (``ratio_level``,
    ``loss_agg``, ``kl_estimator``, ``kl_placement``, ``is_mode``) raises `GRPOError` naming
    the allowed values.

    Advantages
        std_normalize: divide group-centred rewards by the group's (unbiased) std, as the
            original GRPO does. Off by default (Dr. GRPO): the std division up-weights
            groups that are nearly solved or nearly hopeless.
        leave_one_out: RLOO baseline, the mean of the *other* samples of the group.
        mean_normalize: divide group-centred rewards by the group's mean reward (at least
            1 / group size): for pass/fail rewards, the gradient of the sum over prompts of
            log(pass rate). Each prompt is pushed in proportion to one over its pass rate,
            so the objective does not reward trading a task kind the policy rarely solves
            for one it often solves. Not with std_normalize.
        std_eps: added to the std before dividing.
        skip_equal_reward_groups: DAPO dynamic sampling. A group whose raw rewards are all
            equal has zero advantage everywhere; skipping it saves its forward/backward and
            keeps it out of the loss normaliser. Kept groups still contribute KL/entropy terms.
        failed_group_advantage: the advantage of every sample of a group in which every
            reward is 0 or below (0: such a group has no signal, and is skipped). A negative
            value trains on those groups (negative-sample reinforcement, Zhu et al., 2025):
            the policy is pushed away from what it did on a task it fails at, so an answer a
            task needs, which lost its probability to another task's answer, gets it back.
            Such groups are kept even with skip_equal_reward_groups.

    Ratio and clipping
        ratio_level: ``token`` (PPO/GRPO/DAPO: one ratio per token) or ``sequence`` (GSPO:
            the length-normalised sequence ratio exp(mean_t log ratio), applied to every token
            with GSPO-token gradients). GSPO's paper uses clip_eps 3e-4 / 4e-4.
        clip_eps_low, clip_eps_high: the ratio is clipped to [1 - low, 1 + high]; setting
            high > low is DAPO's clip-higher (0.2 / 0.28).
        dual_clip: if set (e.g. 3.0), the loss of a negative-advantage token is bounded by
            dual_clip * |A| (dual-clip PPO), so a huge ratio cannot dominate a step.
        log_ratio_clamp: every log ratio (policy, importance, KL) is clamped to
            [-c, c] before ``exp``; beyond the clamp the gradient is zero. Keeps fp32 finite.

    Aggregation
        loss_agg: ``token-mean`` (every token weighs the same; DAPO), ``seq-mean-token-mean``
            (original GRPO: mean over tokens, then over sequences), ``seq-mean-token-sum``
            (sum over tokens, mean over sequences), ``constant`` (Dr. GRPO: sum over tokens
            divided by ``max_tokens``, mean over sequences; no length bias).
        max_tokens: the constant of the ``constant`` aggregation; set it to the maximum
            number of loss tokens a trajectory may have.

    KL to a reference policy
        kl_coef: 0 disables the penalty (and the need for reference log-probs).
        kl_estimator: Schulman's k1 (log p/q), k2 (half squared log ratio) or k3
            ((q/p - 1) - log q/p), from the sampled tokens' log-probs; Composer 2 used k1: k3's
            variance grows as the policies drift. Or ``forward``: the exact KL(pi_ref || pi)
            over the whole vocabulary at every loss position, which the forward hook computes
            (`ForwardOutput.kl`, e.g. with `forward_kl`). The sampled estimators only see
            tokens the policy still samples, so they barely charge it for a next token the
            reference gave real probability and the policy has dropped; the forward KL's
            gradient pushes each such token back towards the reference's probability
            (mass-covering), which is what keeps RL from unlearning an answer it stopped
            trying. Loss placement only.
        kl_placement: ``loss`` adds kl_coef * KL per token to the loss; ``reward`` subtracts
            kl_coef * (sum of per-token KL of the rollout) from each reward before advantages.

    Importance correction (trainer vs rollout engine log-probs)
        is_mode: ``none``; ``token_tis`` (min(rho_t, cap)); ``token_mis`` (rho_t, zeroed
            outside [is_lower, cap]); ``sequence_mis`` (product of rho_t over the sequence,
            zeroed outside the band); ``geometric_mis`` (accept the sequence, weight 1, when the
            geometric mean of rho_t lies in the band; reject it, weight 0, otherwise).
        is_cap: upper bound (default 2, the verl/TRL TIS default). For ``geometric_mis`` use a
            tight band such as 1.01.
        is_lower: lower bound of the masked modes; None means 0 for token/sequence modes and
            1 / is_cap for ``geometric_mis``.

    Trainer
        entropy_coef: weight of an entropy bonus (needs the forward hook to return entropy).
        micro_batch_size: sequences per forward/backward; the update does not depend on it.
        max_grad_norm: gradient clipping threshold; None only measures the norm.
    """

    std_normalize: bool = False
    leave_one_out: bool = False
    mean_normalize: bool = False
    std_eps: float = 1e-6
    skip_equal_reward_groups: bool = True
    failed_group_advantage: float = 0.0

    ratio_level: RatioLevel = "token"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None
    log_ratio_clamp: float = 20.0

    loss_agg: LossAggregation = "constant"
    max_tokens: int = 4096

    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k1"
    kl_placement: KLPlacement = "loss"

    is_mode: ISMode = "token_tis"
    is_cap: float = 2.0
    is_lower: float | None = None

    entropy_coef: float = 0.0
    micro_batch_size: int = 8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> GRPOError:
            return GRPOError(f"GRPOConfig.{field}={getattr(self, field)!r}: {why}")

        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise bad(name, f"must be one of {', '.join(map(repr, choices))}")
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef", "entropy_coef", "std_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise bad(name, "must be a finite number >= 0")
        if self.std_normalize and self.mean_normalize:
            raise bad("mean_normalize", "std_normalize rescales the advantages too: pick one")
        if not (math.isfinite(self.failed_group_advantage) and self.failed_group_advantage <= 0):
            raise bad("failed_group_advantage", "must be a finite number <= 0 (0: off)")
        if self.clip_eps_low >= 1:
            raise bad("clip_eps_low", "must be < 1 so the lower clip bound 1 - eps stays > 0")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise bad("dual_clip", "must be > 1 (typical: 3.0) or None to disable dual clipping")
        if not (math.isfinite(self.log_ratio_clamp) and 0 < self.log_ratio_clamp <= 80):
            raise bad("log_ratio_clamp", "must be in (0, 80] so exp() stays finite in fp32")
        if self.kl_estimator == "forward" and self.kl_placement != "loss":
            raise bad(
                "kl_placement",
                "must be 'loss' with kl_estimator='forward' (the hook computes that KL in the "
                "gradient pass, after the rewards are turned into advantages)",
            )
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1 (the maximum loss tokens per trajectory)")
        if not (math.isfinite(self.is_cap) and self.is_cap > 0):
            raise bad("is_cap", "must be a finite number > 0 (verl/TRL default: 2.0)")
        if self.is_lower is not None and not (0 <= self.is_lower < self.is_cap):
            raise bad("is_lower", f"must be in [0, is_cap={self.is_cap}) or None")
        if self.micro_batch_size < 1:
            raise bad("micro_batch_size", "must be >= 1 sequence")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise bad("max_grad_norm", "must be > 0, or None to only measure the norm")


# The enum-like settings and their allowed values, read from the Literal annotations above.
_CHOICES: dict[str, tuple[str, ...]] = {
    name: get_args(hint)
    for name, hint in get_type_hints(GRPOConfig).items()
    if get_origin(hint) is Literal
}
