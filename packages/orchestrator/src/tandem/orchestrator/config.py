"""The run configuration: plain msgspec Structs, free of torch.

One section per concept. Where a library already has the config of its concept, the run
config nests it as it is: `MoEConfig` (``[model]``), `EnvConfig` with its `SandboxConfig`
(``[env]``, ``[env.sandbox]``, ``[env.sandbox.limits]``) and `GRPOConfig`
(``[trainer.loss]``); the sections here hold what is the orchestrator's own. A difference
from a library default (the demo's small model) is a value in ``configs/*.toml``, never a
second struct. Every section rejects unknown fields and checks its values in
``__post_init__``: a bad config fails at start with the offending key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from tandem.agent_env import EnvConfig
from tandem.grpo.config import GRPOConfig
from tandem.moe_determinism.model.config import MoEConfig
from tandem.moe_determinism.model.model_dir import with_checkpoint_shapes
from tandem.orchestrator.category_config import (
    CATEGORY_KEYS,
    CategoryBalanceConfig,
    CurriculumConfig,
)
from tandem.orchestrator.compaction_config import CompactionConfig
from tandem.orchestrator.config_checks import ConfigValueError, require_read_only
from tandem.orchestrator.config_checks import require as _require
from tandem.orchestrator.inference.engine_config import EngineConfig, VllmConfig
from tandem.orchestrator.task_config import TaskConfig

__all__ = [
    "CATEGORY_KEYS",
    "CategoryBalanceConfig",
    "CompactionConfig",
    "ConfigValueError",
    "CurriculumConfig",
    "EngineConfig",
    "EpisodeConfig",
    "EvalConfig",
    "MidtrainConfig",
    "RLConfig",
    "RayConfig",
    "RunConfig",
    "RunSettings",
    "TaskConfig",
    "TrainerConfig",
    "VllmConfig",
]


class RunSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where a run writes (``output_dir/name``) and the seed every stage draws from."""

    name: str = "tandem"
    seed: int = 0
    output_dir: str = "runs"

    def __post_init__(self) -> None:
        _require(bool(self.name) and "/" not in self.name, "name", "must be a plain name")

    @property
    def dir(self) -> Path:
        return Path(self.output_dir) / self.name


class EpisodeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How episodes are rendered to the policy's tokens (rollouts, evaluations and the
    mid-training transcripts alike).

    ``max_observation_chars``: a tool observation longer than this keeps its head and tail
    and says how much was cut (a small model's context cannot hold a whole file).
    ``compaction``: what an episode does when its context fills (`CompactionConfig`)."""

    max_observation_chars: int = 600
    compaction: CompactionConfig = msgspec.field(default_factory=CompactionConfig)

    def __post_init__(self) -> None:
        _require(self.max_observation_chars >= 64, "max_observation_chars", "must be >= 64")


class TrainerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Optimizer and replay of the RL trainer.

    ``replay``: R3 replays the experts the engine used, R2 the trainer's own no-grad pass,
    ``none`` lets the trainer route freely. ``routing_check_rows``: rows per step re-run
    without replay to measure routing agreement without it (0 disables the extra pass).
    ``kl_check_rows``: rows per step also scored by the policy the run started from, for
    the KL-to-start metrics (``kl_to_start_k1``/``_k3``: how far RL has moved the policy);
    0 disables that pass. With ``loss.kl_coef`` > 0 every row is scored anyway.
    ``processes``: data-parallel trainer ranks (Ray actors on the ``ray`` backend). The
    ``local`` backend trains in one process that accumulates gradients as that many ranks
    would, so the same config gives the same weights on both backends. ``parallel``: how
    the ranks hold the model: ``ddp`` (each a whole copy, gradients all-reduced) or
    ``fsdp`` (torch's `fully_shard`: parameters, gradients and optimizer state sharded
    along dim 0, each rank publishing its own shards). ``share_prefixes``: feed each group's
    common prefix (the prompt, and any first turn all its rollouts agree on) once per
    micro-batch instead of once per rollout; the log-probs are the same bits.
    ``updates_per_step``: optimizer updates on each step's batch (PPO epochs). The first is
    taken from the rollout policy; the others reuse the batch with the first pass's
    log-probs as the clipped ratio's old policy. The policy version still advances by one
    per step (one published version), so staleness keeps its meaning. Only the first pass
    is compared with the engine: the later ones run torch's own kernels (the trainer's thread
    alone), unless ``exact_later_updates``. ``logits_chunk``: the tokens whose logits are
    formed at once when scoring (each chunk's logits are recomputed in backward, so memory
    does not grow with tokens x vocabulary; 0: a micro-batch's at once); the log-probs are
    the same bits either way. ``activation_checkpointing``: each decoder layer's activations
    are recomputed in backward instead of kept (memory bounded by one layer's, for about one
    more forward of time). ``loss``: the GRPO loss, advantages and importance correction
    (`tandem.grpo.GRPOConfig`); with ``loss.kl_coef`` > 0 the trainer keeps a frozen copy of
    the policy the run started from as the KL reference.
    """

    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: list[float] = msgspec.field(default_factory=lambda: [0.9, 0.99])
    replay: Literal["R3", "R2", "none"] = "R3"
    routing_check_rows: int = 4
    kl_check_rows: int = 0
    processes: int = 1
    parallel: Literal["ddp", "fsdp"] = "fsdp"
    share_prefixes: bool = True
    updates_per_step: int = 1
    exact_later_updates: bool = False
    logits_chunk: int = 0
    activation_checkpointing: bool = False
    loss: GRPOConfig = msgspec.field(default_factory=GRPOConfig)

    def __post_init__(self) -> None:
        _require(self.lr > 0, "lr", "must be > 0")
        _require(self.logits_chunk >= 0, "logits_chunk", "must be >= 0 (0: no chunks)")
        _require(self.kl_check_rows >= 0, "kl_check_rows", "must be >= 0 (0: no KL check)")
        _require(self.processes >= 1, "processes", "must be >= 1")
        _require(self.updates_per_step >= 1, "updates_per_step", "must be >= 1")
        _require(len(self.betas) == 2, "betas", "must be two numbers")


class RayConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``ray`` backend: rollout actors on a Ray cluster.

    ``address``: the cluster to join (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``); empty
    starts a cluster in this process with ``num_cpus`` CPUs (0: all of the machine's).
    ``workers``: rollout actors at start, each one engine with its own weight subscriber,
    declaring ``worker_cpus`` / ``worker_gpus``; each trainer rank declares ``trainer_cpus`` /
    ``trainer_gpus``; ``torch_threads`` (0: Ray's default, one per CPU declared) is set in
    every actor. ``pull_from``: the store URL the actors
    pull weights from when it is not the one the trainer publishes to (a region's relay).
    ``poll_s``: how often an actor looks for a new version without being told.
    ``replace_lost``: start a new actor when one dies, keeping the pool at its size.
    ``stall_s``: an actor that has not returned a group this long past the group's episode
    budget (``episode_wall_s + grade_timeout_s``) is hung: it is killed, counted lost, and
    the group re-queued. ``env_pools``: environment-pool actors (declaring ``env_cpus``
    each) that run every episode's sandbox, apart from the engines; 0 runs the sandboxes
    inside each rollout actor. ``trainer_nice``: the nice value (0-19) of every trainer rank,
    for ranks that share cores with rollout engines: a higher value than the engines' (Ray
    starts workers at 15) lets the engines, which the trainer waits for, take the CPU first
    (see `tandem.orchestrator.runtime.priority`); -1 keeps the value Ray gives.
    """

    address: str = ""
    num_cpus: int = 0
    workers: int = 2
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0
    torch_threads: int = 0
    trainer_cpus: float = 1.0
    trainer_gpus: float = 0.0
    pull_from: str = ""
    poll_s: float = 2.0
    replace_lost: bool = True
    stall_s: float = 120.0
    env_pools: int = 0
    env_cpus: float = 1.0
    trainer_nice: int = -1

    def __post_init__(self) -> None:
        _require(self.stall_s > 0, "stall_s", "must be > 0")
        _require(
            -1 <= self.trainer_nice <= 19,
            "trainer_nice",
            "must be a nice value in 0..19, or -1 (keep Ray's)",
        )
        _require(self.env_pools >= 0, "env_pools", "must be >= 0 (0: sandboxes in each actor)")
        _require(self.env_cpus >= 0, "env_cpus", "must be >= 0")
        _require(self.workers >= 1, "workers", "must be >= 1")
        _require(self.worker_cpus >= 0, "worker_cpus", "must be >= 0")
        _require(self.worker_gpus >= 0, "worker_gpus", "must be >= 0")
        _require(self.num_cpus >= 0, "num_cpus", "must be >= 0 (0: all CPUs)")
        _require(self.torch_threads >= 0, "torch_threads", "must be >= 0 (0: torch's default)")
        _require(self.poll_s > 0, "poll_s", "must be > 0")


class RLConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The asynchronous (or synchronous) GRPO stage.

    ``mode``: ``async`` overlaps rollouts and training; ``sync`` alternates them (max_staleness
    is then 0 by construction); ``pipelined`` overlaps them in lock step: step k+1's groups
    play on version k (every engine on it, none swapping mid-group) while the trainer trains
    step k on groups of version k-1, so staleness is exactly 1 (0 in the first two steps)
    and the run depends only on its seeds, not on timing or the number of engines.
    ``max_staleness``: a group produced by policy version v is trained on only while
    trainer_version - v <= max_staleness (the rule: `tandem.orchestrator.rl.staleness`).
    ``rollout_workers``: groups in flight at once. ``max_ahead``: how many trainer steps
    rollouts may start ahead (0: max_staleness + 1, the bound that keeps drops rare).
    ``backend``: where the engines run, ``local`` (one in this process), ``process`` (one in
    a child process: `ProcessRollouts`) or ``ray`` (rollout actors, see `RayConfig`).
    ``curriculum``: which tasks at the cursor are played. ``torch_threads``: torch's CPU
    threads of this process and of a ``process`` engine (0: torch's default; Ray actors have
    ``ray.torch_threads``; on 2 cores 1 lets the engine and the trainer each have a core).
    ``trainer_threads_alone``: the trainer's threads while no group is being played (0:
    ``torch_threads`` throughout; `SpareCores`; engines on this machine only).
    ``max_equal_groups``: equal-reward groups in a row that end the run (0: it waits on).
    ``tool_error_penalty``: taken off an episode's training reward for each call the
    environment answered with an error (an edit whose old text is not in the file, a
    malformed call), so that a group in which no sample solved its task still ranks its
    samples; pass rates and per-category rewards stay the environment's."""

    mode: Literal["async", "sync", "pipelined"] = "async"
    backend: Literal["local", "process", "ray"] = "local"
    steps: int = 20
    group_size: int = 4
    groups_per_step: int = 4
    max_staleness: int = 1
    rollout_workers: int = 8
    max_ahead: int = 0
    buffer_capacity: int = 64
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    anchor_every: int = 20
    weights_store: str = ""
    torch_threads: int = 0
    trainer_threads_alone: int = 0
    max_equal_groups: int = 0
    tool_error_penalty: float = 0.0
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    curriculum: CurriculumConfig = msgspec.field(default_factory=CurriculumConfig)
    category_balance: CategoryBalanceConfig = msgspec.field(default_factory=CategoryBalanceConfig)

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "steps", "must be >= 1")
        _require(self.group_size >= 2, "group_size", "must be >= 2 (GRPO compares samples)")
        _require(self.groups_per_step >= 1, "groups_per_step", "must be >= 1")
        _require(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        _require(self.rollout_workers >= 1, "rollout_workers", "must be >= 1")
        _require(self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
        _require(self.max_ahead >= 0, "max_ahead", "must be >= 0 (0: max_staleness + 1)")
        _require(self.torch_threads >= 0, "torch_threads", "must be >= 0 (0: torch's default)")
        _require(self.max_equal_groups >= 0, "max_equal_groups", "must be >= 0 (0: no limit)")
        _require(
            self.trainer_threads_alone == 0
            or (self.backend != "ray" and self.trainer_threads_alone >= self.torch_threads > 0),
            "trainer_threads_alone",
            "must be 0, or >= torch_threads (set, > 0) with the local or process backend",
        )
        _require(self.tool_error_penalty >= 0, "tool_error_penalty", "must be >= 0")


class MidtrainConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Next-token training on standard-library code and oracle transcripts.

    ``transcripts``: oracle episodes on generated training tasks (rendered in the chat and
    tool-call format); ``transcript_fraction``: share of each batch's sequences that are
    transcripts (the rest are packed code windows of ``window`` tokens);
    ``transcript_loss``: ``all`` tokens of a transcript or only the ``assistant`` turns.
    ``skip_tools``: read-only calls the oracle does not play, left out of the transcripts.
    ``edit_min_chars``: the oracle's edits are narrowed to the shortest unique text around the
    change that is at least this long (see `minimal_edit`). ``detour_fraction``: share of the
    transcripts that first try a sibling task's fix, get the edit tool's error and recover
    (see `detours`; needs ``env.max_turns`` >= 3). ``logits_chunk`` and
    ``activation_checkpointing``: as the trainer's (`TrainerConfig`), for the next-token
    loss (a real vocabulary's logits of a whole batch are the largest tensor of a step:
    8 windows of 512 tokens over 49,152 ids are 0.8 GB, and their gradient as much again).
    ``init_seed``: the seed of the fresh model's initial weights.
    """

    steps: int = 300
    batch_size: int = 8
    window: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    transcripts: int = 400
    transcript_fraction: float = 0.75
    transcript_loss: Literal["all", "assistant"] = "all"
    skip_tools: list[str] = msgspec.field(default_factory=lambda: ["list_dir", "run_tests"])
    edit_min_chars: int = 10
    detour_fraction: float = 0.0
    code_bytes: int = 4_000_000
    log_every: int = 10
    init_seed: int = 0
    logits_chunk: int = 0
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "steps", "must be >= 1")
        _require(self.logits_chunk >= 0, "logits_chunk", "must be >= 0 (0: no chunks)")
        _require(self.batch_size >= 1, "batch_size", "must be >= 1")
        _require(0 <= self.transcript_fraction <= 1, "transcript_fraction", "must be in [0, 1]")
        _require(self.lr > 0, "lr", "must be > 0")
        _require(self.edit_min_chars >= 1, "edit_min_chars", "must be >= 1")
        _require(0 <= self.detour_fraction <= 1, "detour_fraction", "must be in [0, 1]")
        require_read_only(self.skip_tools, "skip_tools")


class EvalConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Held-out evaluation: ``tasks`` tasks of ``tasks.eval_seed``, ``samples`` each, pass@k
    for each k in ``ks``; ``engines`` policy replicas (worker processes of one torch thread
    each; 0: one per core) share the tasks, which changes the wall time, never the result."""

    tasks: int = 32
    samples: int = 1
    ks: list[int] = msgspec.field(default_factory=lambda: [1])
    engines: int = 1

    def __post_init__(self) -> None:
        _require(self.tasks >= 1, "tasks", "must be >= 1")
        _require(self.samples >= 1, "samples", "must be >= 1")
        _require(self.engines >= 0, "engines", "must be >= 0 (0: one per core)")
        _require(
            bool(self.ks) and min(self.ks) >= 1 and max(self.ks) <= self.samples,
            "ks",
            f"must be in [1, samples={self.samples}]",
        )


BYTE_VOCAB_SIZE = 266
"""The byte tokenizer's vocabulary (`ByteTokenizer.vocab_size`; a test keeps them equal)."""


def byte_level_model() -> MoEConfig:
    """The reference MoE's defaults, with the vocabulary of the byte tokenizer (256 bytes
    and 10 special tokens) that the stages use."""
    return MoEConfig(vocab_size=BYTE_VOCAB_SIZE)


class RunConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything the stages (mid-training, RL, evaluation) read; one TOML file describes a
    whole run. ``policy``: the policy directory RL and evaluation start from (default: the
    run's ``midtrained/``, or ``model.path``, a Hugging Face directory, while there is none)."""

    run: RunSettings = msgspec.field(default_factory=RunSettings)
    model: MoEConfig = msgspec.field(default_factory=byte_level_model)
    tasks: TaskConfig = msgspec.field(default_factory=TaskConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    episode: EpisodeConfig = msgspec.field(default_factory=EpisodeConfig)
    midtrain: MidtrainConfig = msgspec.field(default_factory=MidtrainConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    rl: RLConfig = msgspec.field(default_factory=RLConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    policy: str = ""

    def __post_init__(self) -> None:
        if self.model.path:  # the checkpoint's shapes, checked
            self.model = with_checkpoint_shapes(self.model, byte_level_model(), name="model")
        _require(
            self.trainer.processes <= self.rl.groups_per_step,
            "trainer.processes",
            f"{self.trainer.processes} ranks for rl.groups_per_step = "
            f"{self.rl.groups_per_step}: every trainer rank trains on whole groups, so there "
            "must be at least as many groups per step as ranks",
        )
        self.episode.compaction.check_window(self.engine.max_len)

    @property
    def run_dir(self) -> Path:
        return self.run.dir

    @property
    def policy_dir(self) -> Path:
        midtrained = self.run_dir / "midtrained"
        if self.policy or (self.model.path and not midtrained.exists()):
            return Path(self.policy or self.model.path)
        return midtrained
