"""Log-probs of sampled tokens, computed the same way by the inference engine and the trainer.

An engine samples token t from ``sampling_logits(logits, temperature)`` and reports its
log-prob; the trainer scores the same token with the same two functions. Under
`batch_invariant()` both steps are row-invariant, so the two log-probs are the same bits at
any temperature (the importance ratio between rollout and trainer is then exactly 1 for
tokens of the trainer's own version).

A checkpoint's embedding may have more rows than its tokenizer has ids (Qwen3: 151936 rows,
151669 ids). ``vocab`` keeps only the tokenizer's ids: the rows past it are padding no text
maps to, so they are neither sampled nor part of the normalisation, for engine and trainer
alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sampling_logits(
    logits: torch.Tensor, temperature: float, vocab: int | None = None
) -> torch.Tensor:
    """fp32 logits of the distribution tokens are sampled from: divided by ``temperature``,
    except at 0 (greedy) and 1, which leave them as they are. With ``vocab`` below the
    logits' width only the first ``vocab`` ids remain (the ids a tokenizer can decode), so an
    id at or past it is never sampled and its probability is not counted."""
    if vocab is not None and vocab < logits.shape[-1]:
        logits = logits[..., :vocab].contiguous()
    logits = logits.float()
    return logits if temperature in (0.0, 1.0) else logits / temperature


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at each position from the logits *at that position* (no shift): fp32
    log-softmax over the vocabulary, then a gather. Callers align logits and targets
    themselves (the engine passes one row per sampled token, the trainer the logits of
    positions 0..n-2 with tokens 1..n-1)."""
    return F.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def target_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_logprobs` (the same bits: one fp32 log-softmax, then the gather) and the
    entropy of each position's whole distribution, from that one log-softmax.

    The entropy is how spread the policy still is over its next token: RL that settles on
    one answer per prompt shows it falling. Without ``entropy_grad`` it is a metric and takes
    no part in the backward pass."""
    logp = F.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy
