"""Score a micro-batch with each group's shared prefix computed once.

The rollouts of a GRPO group start from the same prompt, and a small policy usually opens
them with the same first call too, so most of a group's tokens are one shared prefix:
about 70% in the demo's episodes (over 80% when they had two turns). Scoring every row
whole repeats that prefix's forward and backward once per rollout. Here each group's longest
common prefix (same tokens and, under R3, the same recorded experts) is fed once, and each
row only its own tokens, attending to the prefix's keys (`MoETransformer.forward(parents=...)`).
Under `batch_invariant()` the log-probs are the bits of scoring each row whole, so the
mismatch against the engine stays zero; the gradient is the same sum in another order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.grpo import RolloutBatch, forward_kl
from tandem.moe_determinism import (
    MoETransformer,
    RouterReplay,
    RoutingTrace,
    sampling_logits,
    target_logprobs_entropy,
)


class TokenScores(NamedTuple):
    """Per-token log-probs [B, T] of a batch's tokens, the entropy [B, T] of the distribution
    each was drawn from, and, when a reference was given, the exact KL(reference || policy)
    [B, T] of that distribution (position 0 and padding 0)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor | None = None


class SharedLayout:
    """A micro-batch packed as shared prefixes plus each row's own tokens.

    ``tokens`` / ``targets`` [N]: fed tokens and the token each predicts, sequence after
    sequence; ``cu_seqlens`` [S + 1]; ``parents`` [S]; ``routes``: the recorded experts of
    each sequence's tokens; ``index`` [B, T - 1]: the flat position of row b's token t (N
    where the row has none), so the row's log-probs are a gather from the flat ones.
    ``shared_tokens``: the tokens not fed again (each prefix once per row beyond the first).
    With ``share`` False every row is fed whole (no prefix is shared).
    """

    def __init__(self, batch: RolloutBatch, match_routes: bool, share: bool = True) -> None:
        ids = batch.input_ids
        assert batch.attention_mask is not None
        b, t = ids.shape
        fed = (batch.attention_mask.sum(1) - 1).clamp_min(0).tolist()
        routes = batch.extras["routes"]
        tokens: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        route_parts: list[torch.Tensor] = []
        parents: list[int] = []
        index = torch.full((b, max(t - 1, 1)), -1, dtype=torch.long)
        self.shared_tokens = 0
        offset = 0

        def add(row: int, start: int, end: int, parent: int) -> int:
            nonlocal offset
            tokens.append(ids[row, start:end])
            targets.append(ids[row, start + 1 : end + 1])
            route_parts.append(routes[row, start:end])
            parents.append(parent)
            first = offset
            offset += end - start
            return first

        for rows in self._groups(batch):
            shared = 0
            if share:
                shared = self._common_prefix(
                    ids, routes, rows, [fed[r] for r in rows], match_routes
                )
            parent, first = -1, 0
            if shared:
                parent, first = len(parents), add(rows[0], 0, shared, -1)
                self.shared_tokens += shared * (len(rows) - 1)
            for r in rows:
                if shared:
                    index[r, :shared] = first + torch.arange(shared)
                if fed[r] > shared:
                    start = add(r, shared, fed[r], parent)
                    index[r, shared : fed[r]] = start + torch.arange(fed[r] - shared)
        index[index < 0] = offset  # the zero appended after the flat log-probs
        self.tokens = torch.cat(tokens) if tokens else ids.new_zeros(0)
        self.targets = torch.cat(targets) if targets else ids.new_zeros(0)
        lengths = torch.tensor([len(x) for x in tokens])
        self.cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))
        self.parents = torch.tensor(parents)
        self.routes = route_parts
        self.index = index

    @staticmethod
    def _groups(batch: RolloutBatch) -> list[list[int]]:
        """Row indices of each group, in order of first appearance."""
        out: dict[int, list[int]] = {}
        for row, g in enumerate(batch.group_ids.tolist()):
            out.setdefault(g, []).append(row)
        return list(out.values())

    @staticmethod
    def _common_prefix(
        ids: torch.Tensor,
        routes: torch.Tensor,
        rows: list[int],
        fed: list[int],
        match_routes: bool,
    ) -> int:
        """How many leading tokens all ``rows`` can be fed as one: fed token i is shared if
        it and its target (token i + 1) are the same in every row and, with ``match_routes``,
        so are its recorded experts. Every row keeps at least one token of its own; 0 for a
        group of one."""
        limit = min(fed) - 1
        if len(rows) < 2 or limit <= 0:
            return 0
        sel = torch.tensor(rows)
        same = (ids[sel, 1 : limit + 1] == ids[rows[0], 1 : limit + 1]).all(0)
        same &= (ids[sel, :limit] == ids[rows[0], :limit]).all(0)
        if match_routes:
            r = routes[sel, :limit].flatten(2)
            same &= (r == r[:1]).all(-1).all(0)
        return int(same.int().cumprod(0).sum())


def score_shared(
    model: MoETransformer,
    batch: RolloutBatch,
    replay: str,
    temperature: float = 1.0,
    layout: SharedLayout | None = None,
    vocab: int | None = None,
    *,
    entropy_grad: bool = False,
    reference: MoETransformer | None = None,
    logits_chunk: int = 0,
) -> TokenScores:
    """Log-probs [B, T] of ``batch`` (position 0 and padding 0), as `trainer.score` gives
    them on every real token, with each group's common prefix computed once (``layout``:
    this batch's, if the caller already built it), and each position's entropy (with its
    gradient when ``entropy_grad``, for an entropy bonus in the loss). With ``reference``
    (a frozen policy, fed the same tokens under the same routes, without gradient) also the
    exact forward KL of every position's distribution to the reference's. With
    ``logits_chunk`` (and no reference) the logits are formed that many tokens at a time
    inside the pass (`MoETransformer`'s ``score``): the same bits, without [tokens,
    vocabulary] logits for the whole micro-batch."""
    if layout is None:
        layout = SharedLayout(batch, match_routes=replay == "R3")
    if not layout.routes:  # no row has a token to score (every row is one token)
        zeros = torch.zeros_like(batch.input_ids, dtype=torch.float32)
        return TokenScores(zeros, zeros.clone(), None if reference is None else zeros.clone())
    n_exp = getattr(model, "module", model).config.num_experts  # DDP wraps the model
    kwargs = {"cu_seqlens": layout.cu_seqlens, "parents": layout.parents}
    traces = None
    if replay == "R3":
        traces = [RoutingTrace.from_ids(r.long().numpy(), n_exp) for r in layout.routes]
    elif replay == "R2":
        with torch.no_grad():
            traces = model(layout.tokens, **kwargs).traces()
    mode = "R3" if replay == "R3" else "R2"

    def routing() -> RouterReplay | None:  # each pass consumes its own copy of the routes
        return None if traces is None else RouterReplay(traces, mode)

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return F.pad(torch.cat([values, values.new_zeros(1)])[layout.index], (1, 0))

    if logits_chunk and reference is None:

        def token_scores(where: slice, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
            logits = sampling_logits(logits, temperature, vocab)
            return target_logprobs_entropy(logits, layout.targets[where], entropy_grad=entropy_grad)

        out = model(
            layout.tokens,
            routing=routing(),
            score=token_scores,
            score_rows=logits_chunk,
            **kwargs,
        )
        assert out.scores is not None
        flat, entropy = out.scores
        return TokenScores(per_row(flat), per_row(entropy), None)
    out = model(layout.tokens, routing=routing(), **kwargs)
    logits = sampling_logits(out.logits, temperature, vocab)
    flat, entropy = target_logprobs_entropy(logits, layout.targets, entropy_grad=entropy_grad)

    kl = None
    if reference is not None:
        with torch.no_grad():
            ref = reference(layout.tokens, routing=routing(), **kwargs)
        kl = per_row(forward_kl(logits, sampling_logits(ref.logits, temperature, vocab)))
    return TokenScores(per_row(flat), per_row(entropy), kl)
