"""GRPO step cost versus a plain cross-entropy step of the same model and tokens.

Runs both sides in one process, interleaved, and prints medians and ratios:

- ``policy_loss`` forward+backward alone (from log-probs that require grad), against the
  plain step, to show the loss itself is noise next to the model's forward/backward;
- a full ``GRPOStep.step`` (advantages, dynamic sampling, IS weights, KL, metrics,
  gradient clipping, optimizer step) against a plain step: forward, masked cross-entropy,
  backward, clipping, optimizer step. Target: <= 1.1x.

    uv run python benchmarks/grpo_step.py [--batch 8 --seq 256 --vocab 8192 --dim 256 --layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from tandem.grpo import GRPOConfig, GRPOStep, RolloutBatch, next_token_logprobs, policy_loss


class TinyLM(torch.nn.Module):
    """A small causal transformer LM (pre-norm encoder layers with a causal mask)."""

    def __init__(self, vocab: int, dim: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            dim, max(dim // 64, 1), 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.register_buffer(
            "causal", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        t = ids.shape[1]
        x = self.embed(ids) + self.pos[:t]
        return self.head(self.blocks(x, mask=self.causal[:t, :t], is_causal=True))


def make_batch(args: argparse.Namespace, gen: torch.Generator) -> RolloutBatch:
    b, t = args.batch, args.seq
    ids = torch.randint(0, args.vocab, (b, t), generator=gen)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[:, t // 4 :] = True  # prompt then response
    rollout = -torch.rand(b, t, generator=gen) * 5
    return RolloutBatch(
        input_ids=ids,
        loss_mask=mask,
        rollout_logprobs=rollout,
        rewards=torch.randint(0, 2, (b,), generator=gen).float(),
        group_ids=torch.arange(b) // 4,
        policy_version=torch.zeros(b, dtype=torch.long),
        ref_logprobs=rollout + 0.01,
    )


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: RolloutBatch) -> None:
    logits = model(batch.input_ids)
    targets = batch.input_ids[:, 1:].masked_fill(~batch.loss_mask[:, 1:], -100)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(args, gen)

    plain_model = TinyLM(args.vocab, args.dim, args.layers, args.seq)
    grpo_model = TinyLM(args.vocab, args.dim, args.layers, args.seq)
    grpo_model.load_state_dict(plain_model.state_dict())
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-5)
    config = GRPOConfig(micro_batch_size=args.batch, kl_coef=0.01, skip_equal_reward_groups=False)
    trainer = GRPOStep(
        grpo_model,
        torch.optim.AdamW(grpo_model.parameters(), lr=1e-5),
        config,
        Accelerator(cpu=True),
    )

    with torch.no_grad():
        logp0 = next_token_logprobs(plain_model(batch.input_ids), batch.input_ids)
    adv = torch.randn(args.batch, generator=gen)

    def loss_only() -> None:
        logp = logp0.clone().requires_grad_()
        loss, _ = policy_loss(
            logp,
            logp.detach(),
            adv,
            batch.loss_mask,
            config=config,
            ref_logprobs=batch.ref_logprobs,
        )
        loss.backward()

    samples: dict[str, list[float]] = {"plain": [], "grpo": [], "loss": []}
    for rep in range(args.reps + 2):  # two warm-up rounds, interleaved to share machine noise
        t_plain = timed(lambda: plain_step(plain_model, plain_opt, batch))
        t_grpo = timed(lambda: trainer.step(batch))
        t_loss = min(timed(loss_only) for _ in range(5))
        if rep >= 2:
            samples["plain"].append(t_plain)
            samples["grpo"].append(t_grpo)
            samples["loss"].append(t_loss)
        print(f"rep {rep}: plain {t_plain * 1e3:.1f} ms  grpo {t_grpo * 1e3:.1f} ms", flush=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    params = sum(p.numel() for p in plain_model.parameters())
    print(
        f"\nmodel {params / 1e6:.1f}M params, batch {args.batch} x {args.seq} tokens, "
        f"vocab {args.vocab}, {torch.get_num_threads()} threads, median of {args.reps}"
    )
    print(f"{'what':<40}{'ms':>10}{'x plain step':>15}")
    print(f"{'plain cross-entropy step':<40}{med['plain'] * 1e3:>10.1f}{1.0:>15.3f}")
    print(
        f"{'policy_loss forward+backward':<40}{med['loss'] * 1e3:>10.2f}"
        f"{med['loss'] / med['plain']:>15.3f}"
    )
    print(f"{'GRPOStep.step':<40}{med['grpo'] * 1e3:>10.1f}{med['grpo'] / med['plain']:>15.3f}")
    print(
        f"target: GRPOStep.step <= 1.1x plain step -> "
        f"{'met' if med['grpo'] / med['plain'] <= 1.1 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
