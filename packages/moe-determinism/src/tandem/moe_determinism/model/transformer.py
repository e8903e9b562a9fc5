"""`MoETransformer`: the reference model (Qwen3-MoE, DeepSeek-V3 and the other families) with routing record/replay and a KV cache.

One `forward` serves the inference engine and the trainer:

* padded batch: `input_ids [B, T]` + `lengths [B]` (right padding);
* packed batch: `input_ids [N]` + `cu_seqlens [S + 1]`;
* with `cache` and `slots`: the new tokens of each sequence are appended to its cache slot
  (prefill and one-token decode are the same call);
* `routing=RouterReplay(traces, mode)` forces the recorded experts (R3 / R2); the routes
  actually used are always returned, so recording costs nothing extra.

Internally the valid tokens are flattened sequence after sequence, so padding never costs
matmul work, and row r of every per-token output (logits, route ids) is the r-th valid token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tandem.moe_determinism.errors import MoEDeterminismError
from tandem.moe_determinism.model.basics import RMSNorm, TokenLayout, invariant_cpu_scope
from tandem.moe_determinism.model.cache import KVCache
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.model.layers import DecoderLayer
from tandem.moe_determinism.model.rope import Rope
from tandem.moe_determinism.replay import RouterReplay, RoutingTrace

TokenScoreFn = Callable[[slice, torch.Tensor], tuple[torch.Tensor, ...]]
"""What a caller computes from the logits of a run of valid tokens: ``(rows, logits)`` ->
per-token tensors whose first dimension is those rows (log-probs, entropy, ...)."""


@dataclass
class MoEOutput:
    """logits: [B, T, V] for padded input (zeros at padding), [N, V] for packed input; None
    when the pass was asked for ``scores`` instead.
    route_ids: [N, moe_layers, top_k] experts used by each valid token, in flat token order
    (one entry per MoE layer, `MoEConfig.moe_layers`; none for a dense model).
    counts: new tokens per sequence (to split the flat outputs).
    scores: what ``score`` returned, chunk outputs concatenated: [N, ...] per valid token."""

    logits: torch.Tensor | None
    route_ids: torch.Tensor
    counts: list[int]
    num_experts: int
    scores: tuple[torch.Tensor, ...] | None = None

    def traces(self) -> list[RoutingTrace]:
        """One `RoutingTrace` per sequence, covering the tokens this pass processed."""
        out, start = [], 0
        ids = self.route_ids.cpu().numpy()
        for n in self.counts:
            out.append(RoutingTrace.from_ids(ids[start : start + n], self.num_experts))
            start += n
        return out


class MoETransformer(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.activation_checkpointing = False
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) init (norms at 1), optionally from a fixed seed."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def new_cache(self, max_slots: int, max_len: int) -> KVCache:
        p = next(self.parameters())
        return KVCache(self.config, max_slots, max_len, dtype=p.dtype, device=p.device)

    # ---- input handling -------------------------------------------------------------
    def _layout(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        cache: KVCache | None,
        slots: torch.Tensor | None,
        parents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, TokenLayout, tuple[torch.Tensor, torch.Tensor] | None]:
        dev = input_ids.device
        if cu_seqlens is not None:
            if input_ids.dim() != 1:
                raise MoEDeterminismError(
                    "packed input: input_ids must be 1-D [N] with cu_seqlens [S+1]"
                )
            cu = torch.as_tensor(cu_seqlens, dtype=torch.long, device=dev)
            counts = cu[1:] - cu[:-1]
            if int(cu[0]) != 0 or int(cu[-1]) != input_ids.numel() or bool((counts < 0).any()):
                raise MoEDeterminismError(
                    f"cu_seqlens must start at 0, be non-decreasing and end at N={input_ids.numel()}"
                )
            seq_of = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts)
            index = torch.arange(input_ids.numel(), device=dev) - cu[:-1][seq_of]
            tokens, scatter = input_ids, None
        else:
            if input_ids.dim() != 2:
                raise MoEDeterminismError(
                    "padded input: input_ids must be 2-D [B, T] (or pass cu_seqlens)"
                )
            b, t = input_ids.shape
            counts = (
                torch.full((b,), t, dtype=torch.long, device=dev)
                if lengths is None
                else torch.as_tensor(lengths, dtype=torch.long, device=dev)
            )
            if counts.shape != (b,) or bool((counts < 0).any()) or bool((counts > t).any()):
                raise MoEDeterminismError(f"lengths must be [B]={b} values in [0, {t}]")
            valid = torch.arange(t, device=dev)[None, :] < counts[:, None]
            seq_of, index = valid.nonzero(as_tuple=True)
            tokens, scatter = input_ids[seq_of, index], (seq_of, index)
        if tokens.numel() and (
            int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size
        ):
            raise MoEDeterminismError(
                f"token ids must be in [0, vocab_size={self.config.vocab_size})"
            )
        if cache is not None:
            if slots is None:
                raise MoEDeterminismError(
                    "with a KV cache, pass slots: the cache row of each sequence"
                )
            slots = torch.as_tensor(slots, dtype=torch.long)
            if slots.shape != counts.shape:
                raise MoEDeterminismError(
                    f"slots must have one entry per sequence ({counts.numel()})"
                )
            cache.check_room(slots, counts.cpu())
            offsets = cache.lengths[slots].to(dev)
        elif parents is not None:
            parents = self._check_parents(parents, counts)
            offsets = torch.where(parents >= 0, counts[parents.clamp_min(0)], 0)
        else:
            offsets = torch.zeros_like(counts)
        layout = TokenLayout(
            seq_of=seq_of,
            index=index,
            counts=counts,
            offsets=offsets,
            positions=offsets[seq_of] + index,
            cache=cache,
            slots=slots,
            parents=parents,
        )
        return tokens, layout, scatter

    @staticmethod
    def _check_parents(parents: torch.Tensor | list[int], counts: torch.Tensor) -> torch.Tensor:
        p = torch.as_tensor(parents, dtype=torch.long, device=counts.device)
        s = counts.numel()
        if p.shape != (s,) or bool(((p < -1) | (p >= s)).any()):
            raise MoEDeterminismError(f"parents must be [S]={s} sequence indices or -1")
        has = p >= 0
        if bool((p[has] == torch.arange(s, device=p.device)[has]).any()) or bool(
            (p[p[has]] >= 0).any()
        ):
            raise MoEDeterminismError(
                "parents: a sequence cannot be its own parent, and a parent has no parent "
                f"(one level of sharing); got {p.tolist()}"
            )
        return p

    # ---- forward ----------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor | list[int] | None = None,
        *,
        cu_seqlens: torch.Tensor | list[int] | None = None,
        cache: KVCache | None = None,
        slots: torch.Tensor | list[int] | None = None,
        routing: RouterReplay | None = None,
        parents: torch.Tensor | list[int] | None = None,
        score: TokenScoreFn | None = None,
        score_rows: int = 1024,
    ) -> MoEOutput:
        """``parents`` (no cache): sequence s continues sequence ``parents[s]`` (-1: none);
        its tokens follow all of the parent's, which it attends to. A group of rollouts that
        share a prompt is scored as the prompt once plus each rollout's own tokens, with the
        same per-token results as scoring each whole rollout (under `batch_invariant()`).

        ``score``: instead of logits, return what ``score(rows, logits)`` computes from the
        logits of ``score_rows`` valid tokens at a time (`MoEOutput.scores`). Each chunk's
        logits are recomputed in backward rather than kept, so a pass never holds [tokens,
        vocabulary] logits for more than one chunk; under `batch_invariant()` every row's
        logits are the bits of the whole pass's."""
        cfg = self.config
        if parents is not None and cache is not None:
            raise MoEDeterminismError("parents and a KV cache cannot be combined")
        tokens, layout, scatter = self._layout(
            input_ids, lengths, cu_seqlens, cache, slots, parents
        )
        moe_index = {layer: j for j, layer in enumerate(cfg.moe_layers)}
        if routing is not None:
            routing.bind(
                layout.counts.tolist(),
                len(moe_index),
                cfg.num_experts_per_tok,
                cfg.num_experts,
            )
        use_ckpt = self.activation_checkpointing and torch.is_grad_enabled() and cache is None
        h = self.embed_tokens(tokens)
        rope = Rope.at(
            layout.positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_interleave
        )
        all_ids = []
        for i, layer in enumerate(self.layers):
            # Take the layer's routes outside the checkpointed region: the recompute in backward
            # receives the same tensor as an input and consumes nothing. Traces hold MoE layers
            # only: entry j is the j-th MoE layer, dense layers neither take nor record routes.
            j = moe_index.get(i)
            replay_ids = routing.take(j) if routing is not None and j is not None else None
            if use_ckpt:
                h, ids = checkpoint(layer, h, layout, rope, replay_ids, use_reentrant=False)
            else:
                h, ids = layer(h, layout, rope, replay_ids)
            if ids is not None:
                all_ids.append(ids)
        if routing is not None:
            routing.finish()
        if cache is not None:
            assert layout.slots is not None
            cache.lengths[layout.slots] += layout.counts.cpu()
        if score is not None:
            return MoEOutput(
                logits=None,
                route_ids=self._route_ids(all_ids, tokens.numel()),
                counts=layout.counts.tolist(),
                num_experts=cfg.num_experts,
                scores=self._chunked_scores(h, score, score_rows),
            )
        with invariant_cpu_scope(h):
            logits = self.lm_head(self.norm(h))
        if scatter is not None:
            b, t = input_ids.shape
            full = logits.new_zeros(b, t, logits.shape[-1])
            full[scatter] = logits
            logits = full
        return MoEOutput(
            logits=logits,
            route_ids=self._route_ids(all_ids, tokens.numel()),
            counts=layout.counts.tolist(),
            num_experts=cfg.num_experts,
        )

    def _route_ids(self, all_ids: list[torch.Tensor], tokens: int) -> torch.Tensor:
        if all_ids:
            return torch.stack(all_ids, dim=1)
        return torch.zeros(tokens, 0, self.config.num_experts_per_tok, dtype=torch.long)

    def _chunked_scores(
        self, h: torch.Tensor, score: TokenScoreFn, rows: int
    ) -> tuple[torch.Tensor, ...]:
        """``score`` over the logits of ``rows`` tokens at a time; with gradients, each chunk
        is an activation checkpoint (its logits are recomputed in backward)."""
        if rows < 1:
            raise MoEDeterminismError(f"score_rows must be >= 1, got {rows}")

        def chunk(part: torch.Tensor, where: slice) -> tuple[torch.Tensor, ...]:
            with invariant_cpu_scope(part):  # also for the recompute in backward
                return score(where, self.lm_head(self.norm(part)))

        outs = []
        for start in range(0, h.shape[0], rows):
            where = slice(start, min(start + rows, h.shape[0]))
            if torch.is_grad_enabled():
                outs.append(checkpoint(chunk, h[where], where, use_reentrant=False))
            else:
                outs.append(chunk(h[where], where))
        if not outs:
            outs.append(score(slice(0, 0), h.new_zeros(0, self.config.vocab_size)))
        return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
