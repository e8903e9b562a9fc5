"""A fixed workload whose weights must not change when the code is reorganised.

Runs mid-training and then a ``pipelined`` and a ``sync`` RL run (both reproducible from
their seeds alone) on a tiny MoE, and prints JSON digests of the weights they produce: the
mid-trained policy, every published policy version and the final one. ``probe`` is the
digest of a forward/backward/AdamW step of the reference model alone, which depends only on
this machine's floating-point kernels, not on the pipeline code: when it differs from the
recorded one, the machine computes other bits and the other digests cannot be compared.

Run by `test_behaviour_kept.py` in a fresh interpreter with pinned CPU kernels (see there);
``python tests/behaviour_workload.py OUT_DIR`` writes them to ``OUT_DIR/digests.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import msgspec
import torch
from rl_helpers import TINY  # this directory: the tests' tiny MoE

from tandem.agent_env import EnvConfig
from tandem.grpo import GRPOConfig
from tandem.moe_determinism import MoETransformer, batch_invariant
from tandem.orchestrator import RunConfig, RunHooks, RunSettings, midtrain_policy, reinforce
from tandem.orchestrator.config import (
    CurriculumConfig,
    EngineConfig,
    EpisodeConfig,
    MidtrainConfig,
    RLConfig,
    TaskConfig,
    TrainerConfig,
)
from tandem.orchestrator.midtrain import corpus

TASKS = TaskConfig(
    kinds=["wrong_operator", "off_by_one", "swapped_arguments"],
    functions=["gcd", "digit_sum", "is_palindrome", "chunked"],
    modules=["toolbelt"],
)
ENV = EnvConfig(
    max_turns=3,
    episode_wall_s=300.0,
    grade_timeout_s=60.0,
    system_prompt="Fix the bug with the tools, run the tests, then submit.",
)
ENGINE = EngineConfig(max_slots=16, max_len=2048, max_new_tokens=24, temperature=1.0)
MIDTRAIN = MidtrainConfig(
    steps=12,
    batch_size=4,
    window=64,
    lr=3e-3,
    warmup_steps=4,
    transcripts=12,
    transcript_fraction=0.5,
    transcript_loss="assistant",
    edit_min_chars=4,
    code_bytes=40_000,
    log_every=100,
    init_seed=3,
)
LOSS = {"max_tokens": 512, "clip_eps_high": 0.28, "kl_estimator": "k2"}


def digest(state: dict[str, torch.Tensor]) -> str:
    """blake2b of every tensor's name and bit pattern, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name].detach().contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def probe() -> str:
    """This machine's numerics, from the reference model alone: AdamW steps of a small MoE
    with and without `batch_invariant()` (torch's own kernels, as mid-training uses them)."""
    cfg = msgspec.structs.replace(TINY, vocab_size=64, max_position_embeddings=32768)
    model = MoETransformer(cfg)
    model.reset_parameters(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (3, 100), generator=torch.Generator().manual_seed(0))
    for invariant in (True, True, False, False):
        with batch_invariant(invariant):
            out = model(ids[:, :-1], torch.tensor([99, 70, 41]))
            lp = torch.log_softmax(out.logits.float(), -1)
            loss = -lp.gather(-1, ids[:, 1:, None]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return digest(model.state_dict())


def code_corpus(root: Path) -> Path:
    """Python files of fixed content, standing in for the standard library (which differs
    between Python versions)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(24):
        body = "\n\n".join(
            f"def f{i}_{j}(x, y={j}):\n"
            f'    """Return a mix of x and {j}."""\n'
            f"    total = 0\n"
            f"    for k in range({j + 2}):\n"
            f"        total += (x * k + y) % {i + 7}\n"
            f"    return total if x > {j} else -total\n"
            for j in range(6)
        )
        (root / f"mod_{i:02d}.py").write_text(body + "\n")
    return root


def parity(sample) -> float:
    """A reward that varies even for a policy that solves nothing."""
    return float(sum(sample.tokens[-len(sample.tokens) // 3 :]) % 2)


def rl_run(model, config: RunConfig, run_dir: Path) -> dict:
    published: dict[str, str] = {}
    rewards: list[float] = []

    def on_publish(version: int, state: dict[str, torch.Tensor]) -> None:
        published[str(version)] = digest(state)

    def on_step(step: int, metrics: dict) -> None:
        rewards.append(metrics["reward"])

    summary = reinforce(
        model,
        config,
        run_dir=run_dir,
        task_offset=MIDTRAIN.transcripts,
        hooks=RunHooks(on_publish=on_publish, on_step=on_step, reward=parity),
    )
    return {
        "steps": summary.steps_done,
        "versions": published,
        "final": digest(model.state_dict()),
        "rewards": rewards,
    }


def main(out: Path) -> dict:
    torch.set_num_threads(1)
    corpus.stdlib_root = lambda: code_corpus(out / "corpus")  # type: ignore[assignment]
    result: dict = {"probe": probe()}
    config = RunConfig(
        run=RunSettings(name="mid", seed=7, output_dir=str(out)),
        model=TINY,
        tasks=TASKS,
        env=ENV,
        episode=EpisodeConfig(max_observation_chars=600),
        midtrain=MIDTRAIN,
        engine=ENGINE,
    )
    model, _ = midtrain_policy(config)
    result["midtrain"] = digest(model.state_dict())
    start = {k: v.clone() for k, v in model.state_dict().items()}

    rl_config = msgspec.structs.replace(
        config,
        run=RunSettings(name="rl", seed=5, output_dir=str(out)),
        rl=RLConfig(
            mode="pipelined",
            steps=3,
            group_size=3,
            groups_per_step=2,
            checkpoint_every=2,
            torch_threads=1,
            curriculum=CurriculumConfig(enabled=True, window=1, keep=0.5),
        ),
        trainer=TrainerConfig(
            lr=1e-2,
            replay="R3",
            routing_check_rows=2,
            processes=2,
            updates_per_step=2,
            loss=GRPOConfig(micro_batch_size=2, kl_coef=0.05, **LOSS),
        ),
    )
    result["pipelined"] = rl_run(model, rl_config, out / "pipelined")

    model.load_state_dict(start)
    rl_config = msgspec.structs.replace(
        rl_config,
        rl=RLConfig(mode="sync", steps=2, group_size=3, groups_per_step=2, torch_threads=1),
        trainer=TrainerConfig(
            lr=1e-2,
            replay="R2",
            routing_check_rows=0,
            share_prefixes=False,
            loss=GRPOConfig(micro_batch_size=4, **LOSS),
        ),
    )
    result["sync"] = rl_run(model, rl_config, out / "sync")
    return result


if __name__ == "__main__":
    out = Path(sys.argv[1])
    digests = main(out)
    (out / "digests.json").write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
