"""Log-probs and entropy computed chunk by chunk from the last hidden states (``score=``):
the same bits as from the whole pass's logits under `batch_invariant()`, the same gradient,
and no [tokens, vocabulary] tensor kept for backward beyond one chunk."""

from __future__ import annotations

import pytest
import torch

from tandem.moe_determinism import (
    MoEConfig,
    MoETransformer,
    batch_invariant,
    target_logprobs_entropy,
)

CFG = MoEConfig(
    vocab_size=640,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    kv_split_size=16,
)
LENS = [37, 12, 50]


def _batch() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (sum(LENS),), generator=gen)
    targets = torch.randint(0, CFG.vocab_size, (sum(LENS),), generator=gen)
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    return ids, targets, cu


def _model() -> MoETransformer:
    m = MoETransformer(CFG)
    m.reset_parameters(seed=3)
    return m


@pytest.mark.parametrize("rows", [1, 16, 33, 1000])
def test_chunked_scores_are_the_whole_passs_bits_and_gradient(rows: int) -> None:
    ids, targets, cu = _batch()
    whole_model, chunked_model = _model(), _model()
    with batch_invariant():
        out = whole_model(ids, cu_seqlens=cu)
        lp, ent = target_logprobs_entropy(out.logits, targets, entropy_grad=True)
        (lp.sum() + 0.1 * ent.sum()).backward()

        def score(where: slice, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return target_logprobs_entropy(logits, targets[where], entropy_grad=True)

        got = chunked_model(ids, cu_seqlens=cu, score=score, score_rows=rows)
        assert got.logits is None and got.scores is not None
        clp, cent = got.scores
        (clp.sum() + 0.1 * cent.sum()).backward()
    assert torch.equal(clp.detach(), lp.detach()) and torch.equal(cent.detach(), ent.detach())
    assert torch.equal(got.route_ids, out.route_ids)
    for (name, a), (_, b) in zip(
        whole_model.named_parameters(), chunked_model.named_parameters(), strict=True
    ):
        scale = float(a.grad.abs().max())
        assert float((b.grad - a.grad).abs().max()) <= 1e-5 * scale, name


def test_no_whole_vocabulary_tensor_is_kept_for_backward() -> None:
    ids, targets, cu = _batch()
    biggest = {"whole": 0, "chunked": 0}

    def track(key: str):
        def pack(t: torch.Tensor) -> torch.Tensor:
            biggest[key] = max(biggest[key], t.numel())
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def score(where: slice, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return target_logprobs_entropy(logits, targets[where])

    with batch_invariant():
        with track("whole"):
            target_logprobs_entropy(_model()(ids, cu_seqlens=cu).logits, targets)
        with track("chunked"):
            _model()(ids, cu_seqlens=cu, score=score, score_rows=16)
    assert biggest["whole"] >= sum(LENS) * CFG.vocab_size
    # (the largest then is a weight, e.g. the output embedding: vocabulary x hidden)
    assert biggest["chunked"] < sum(LENS) * CFG.vocab_size // 2
