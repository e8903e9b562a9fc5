"""Mid-training's next-token loss from logits formed a few tokens at a time
(``midtrain.logits_chunk``): the loss of the whole batch's logits, the same gradient."""

from __future__ import annotations

import torch

from tandem.moe_determinism import MoEConfig, MoETransformer, batch_invariant
from tandem.orchestrator.midtrain.trainer import batch_loss, make_batch

CFG = MoEConfig(
    vocab_size=300,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=32,
    num_experts=4,
    kv_split_size=16,
)


def _model() -> MoETransformer:
    m = MoETransformer(CFG)
    m.reset_parameters(seed=1)
    return m


def test_chunked_loss_is_the_whole_batchs() -> None:
    gen = torch.Generator().manual_seed(0)
    items = []
    for n in (30, 17, 41):
        ids = torch.randint(0, 300, (n,), generator=gen).tolist()
        mask = (torch.rand(n, generator=gen) > 0.3).int().tolist()
        items.append((ids, mask))
    ids, lengths, mask = make_batch(items, pad_id=0)
    whole, chunked = _model(), _model()
    chunked.activation_checkpointing = True  # the layers recomputed in backward too
    with batch_invariant():
        a = batch_loss(whole, ids, lengths, mask)
        b = batch_loss(chunked, ids, lengths, mask, logits_chunk=11)
        a.backward()
        b.backward()
    # per token the same bits; the mean adds them in another layout (flat, not padded)
    torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=0.0)
    for (name, p), (_, q) in zip(whole.named_parameters(), chunked.named_parameters(), strict=True):
        scale = float(p.grad.abs().max())
        assert float((q.grad - p.grad).abs().max()) <= 1e-5 * scale, name
