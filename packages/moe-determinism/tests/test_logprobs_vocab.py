"""Padded vocabularies: ids past the tokenizer's are never sampled nor scored.

A checkpoint's embedding may have more rows than its tokenizer has ids. `sampling_logits`
with ``vocab`` keeps the first ``vocab`` ids only; without it (or with ``vocab`` at the
logits' width) it is the function it always was, bit for bit.
"""

from __future__ import annotations

import torch

from tandem.moe_determinism import sampling_logits, target_logprobs


def test_padded_ids_are_dropped_from_the_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g)
    logits[:, 32:] = 50.0  # padding rows that would win every draw if they were kept
    scaled = sampling_logits(logits, 0.7, vocab=32)
    assert scaled.shape == (5, 32)
    assert (scaled.argmax(-1) < 32).all()
    targets = torch.tensor([0, 3, 31, 7, 12])
    got = target_logprobs(scaled, targets)
    # independent: mask the padding with -inf and normalise over the whole width
    masked = (logits / 0.7).masked_fill(torch.arange(40) >= 32, float("-inf"))
    ref = masked.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert torch.allclose(scaled.softmax(-1).sum(-1), torch.ones(5))
    # a Gumbel draw over the kept ids never yields a padded one
    noise = torch.rand(1000, 32, generator=g)
    draws = (scaled[:1] - torch.log(-torch.log(noise.clamp_min(1e-20)))).argmax(-1)
    assert int(draws.max()) < 32


def test_full_vocabulary_is_unchanged_bit_for_bit() -> None:
    logits = torch.randn(3, 24, generator=torch.Generator().manual_seed(1)).bfloat16()
    for temperature in (0.0, 0.5, 1.0):
        plain = sampling_logits(logits, temperature)
        for vocab in (None, 24, 30):
            assert torch.equal(sampling_logits(logits, temperature, vocab), plain)
