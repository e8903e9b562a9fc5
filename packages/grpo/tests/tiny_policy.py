"""A few-thousand-parameter autoregressive policy and a reverse-the-prompt task for tests.

Loaded by conftest.py (as a fixture) and imported by the distributed worker script.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.grpo import RolloutBatch

VOCAB = 6  # tokens 0..4 are symbols, 5 is BOS
BOS = 5
PROMPT = 2
RESPONSE = 2
LENGTH = 1 + PROMPT + RESPONSE


class TinyPolicy(torch.nn.Module):
    """Causal MLP: position t sees the one-hot tokens at positions <= t (future slots zeroed)."""

    def __init__(self, vocab: int = VOCAB, length: int = LENGTH, hidden: int = 64) -> None:
        super().__init__()
        self.vocab, self.length = vocab, length
        self.inp = torch.nn.Linear(length * vocab, hidden)
        self.out = torch.nn.Linear(hidden, vocab)
        self.register_buffer("causal", torch.tril(torch.ones(length, length)), persistent=False)

    def forward(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, t = ids.shape
        x = F.one_hot(ids, self.vocab).float()
        x = x[:, None, :, :] * self.causal[:t, :t, None]
        x = F.pad(x, (0, 0, 0, self.length - t)).reshape(b, t, self.length * self.vocab)
        return self.out(torch.tanh(self.inp(x)))


@torch.no_grad()
def sample_reverse_task(
    model: TinyPolicy,
    num_prompts: int,
    group: int,
    generator: torch.Generator,
    policy_version: int = 0,
) -> RolloutBatch:
    """Sample ``group`` responses per random prompt; reward 1 iff the response reverses it."""
    prompts = torch.randint(0, VOCAB - 1, (num_prompts, PROMPT), generator=generator)
    ids = torch.cat([torch.full((num_prompts, 1), BOS), prompts], 1).repeat_interleave(group, 0)
    logprobs = torch.zeros(ids.shape[0], LENGTH)
    for pos in range(1 + PROMPT, LENGTH):
        logp = torch.log_softmax(model(ids)[:, -1], -1)
        tok = torch.multinomial(logp.exp(), 1, generator=generator)
        logprobs[:, pos] = logp.gather(1, tok)[:, 0]
        ids = torch.cat([ids, tok], 1)
    reward = (ids[:, 1 + PROMPT :] == ids[:, 1 : 1 + PROMPT].flip(1)).all(1).float()
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[:, 1 + PROMPT :] = True
    return RolloutBatch(
        input_ids=ids,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        rewards=reward,
        group_ids=torch.arange(num_prompts).repeat_interleave(group),
        policy_version=torch.full((ids.shape[0],), policy_version),
    )
