"""Scoring trajectories with the policy under router replay: the trainer's log-probs.

The trainer re-scores each trajectory inside `batch_invariant()` with the experts the
engine recorded (R3), or with its own routes from a no-grad pass (R2), or routing freely,
and takes the log-probs of the sampling distribution at the engine's temperature with the
same functions the engine sampled with, so that on the trainer's own version they are the
engine's bits. `ReplayScorer` is the GRPO forward hook that does it per micro-batch (each
group's common prefix fed once with ``share_prefixes``, `prefix_scoring`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.grpo import ForwardOutput, RolloutBatch
from tandem.moe_determinism import (
    MoETransformer,
    RouterReplay,
    RoutingTrace,
    sampling_logits,
    target_logprobs,
)
from tandem.orchestrator.training.prefix_scoring import SharedLayout, TokenScores, score_shared


def _traces(routes: torch.Tensor, lengths: torch.Tensor, num_experts: int) -> list[RoutingTrace]:
    return [
        RoutingTrace.from_ids(routes[i, : int(n)].numpy(), num_experts)
        for i, n in enumerate(lengths.tolist())
    ]


def score(
    model: MoETransformer,
    batch: RolloutBatch,
    replay: str,
    temperature: float = 1.0,
    vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Log-probs [B, T] of ``batch`` (position 0 is 0) and the routes [N, layers, k] used.

    Only tokens 0..n-2 of a row are fed: the last token predicts nothing, and the engine
    never fed it either (so it has no recorded route). Log-probs are those of the sampling
    distribution at the engine's ``temperature`` over the tokenizer's ``vocab`` ids
    (`sampling_logits`, as the engine samples).
    """
    ids = batch.input_ids
    assert batch.attention_mask is not None
    fed = (batch.attention_mask.sum(1) - 1).clamp_min(0)
    inputs = ids[:, :-1] if ids.shape[1] > 1 else ids
    n_exp = getattr(model, "module", model).config.num_experts  # DDP wraps the model
    routing = None
    if replay == "R3":
        routing = RouterReplay(_traces(batch.extras["routes"], fed, n_exp), "R3")
    elif replay == "R2":
        with torch.no_grad():
            own = model(inputs, fed)
        routing = RouterReplay(own.traces(), "R2")
    out = model(inputs, fed, routing=routing)
    logits = sampling_logits(out.logits, temperature, vocab)
    lp = target_logprobs(logits, ids[:, 1:]) if ids.shape[1] > 1 else logits[..., 0]
    lp = F.pad(lp, (1, 0)) if ids.shape[1] > 1 else torch.zeros_like(ids, dtype=torch.float32)
    return lp, out.route_ids, out.counts


def routes_known(batch: RolloutBatch) -> bool:
    """Whether every sample of ``batch`` carries the experts its engine used (`collate`)."""
    return bool(batch.extras.get("routes_known", torch.tensor(True)))


class ScoredPass(NamedTuple):
    """What the forward hook computed for one micro-batch: its rows, their detached
    log-probs, the tokens fed, and the prefix tokens sharing did not feed again."""

    rows: torch.Tensor
    logprobs: torch.Tensor
    tokens_fed: int
    tokens_shared: int


class ReplayScorer:
    """The GRPO forward hook: scores each micro-batch under the run's replay mode, and keeps
    what it computed for the mismatch check and the metrics.

    Every position's entropy comes with the log-probs (with its gradient when the loss has an
    entropy bonus, ``entropy_grad``). With a ``reference`` policy the hook also feeds it the
    same tokens under the same routes and returns the exact forward KL to it per token, for
    ``loss.kl_estimator = "forward"``."""

    def __init__(
        self,
        replay: str,
        temperature: float,
        share_prefixes: bool = True,
        vocab: int | None = None,
        *,
        entropy_grad: bool = False,
        reference: MoETransformer | None = None,
        logits_chunk: int = 0,
    ) -> None:
        self.replay = replay
        self.logits_chunk = logits_chunk
        self.temperature = temperature
        self.vocab = vocab  # the tokenizer's ids (a padded embedding's rows past it are not)
        self.share_prefixes = share_prefixes
        self.entropy_grad = entropy_grad
        self.reference = reference
        self.captured: list[ScoredPass] = []
        self.replayed: set[str] = set()  # the modes `logprobs` used (see `replay_for`)

    def replay_for(self, micro: RolloutBatch) -> str:
        """The run's replay mode, but R2 for R3 on samples whose engine did not report the
        experts it used (vLLM without routed-expert capture, as on a CPU): the trainer then
        replays its own no-grad routes, the closest it can come."""
        if self.replay == "R3" and not routes_known(micro):
            return "R2"
        return self.replay

    def scores(
        self,
        model: torch.nn.Module,
        micro: RolloutBatch,
        reference: MoETransformer | None = None,
    ) -> tuple[TokenScores, SharedLayout]:
        """``micro`` scored by ``model`` (see `score_shared`; each group's common prefix fed
        once with ``share_prefixes``), and the layout it was fed in."""
        replay = self.replay_for(micro)
        self.replayed.add(replay)
        layout = SharedLayout(micro, match_routes=replay == "R3", share=self.share_prefixes)
        scored = score_shared(
            model,  # type: ignore[arg-type]
            micro,
            replay,
            self.temperature,
            layout,
            self.vocab,
            entropy_grad=self.entropy_grad,
            reference=reference,
            logits_chunk=self.logits_chunk,
        )
        return scored, layout

    def __call__(self, model: torch.nn.Module, micro: RolloutBatch) -> ForwardOutput:
        scored, layout = self.scores(model, micro, self.reference)
        fed, shared = len(layout.tokens), layout.shared_tokens
        self.captured.append(ScoredPass(micro.extras["row"], scored.logprobs.detach(), fed, shared))
        return ForwardOutput(scored.logprobs, scored.entropy, scored.kl)
