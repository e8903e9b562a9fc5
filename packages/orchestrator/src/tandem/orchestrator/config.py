"""Run configuration of the pipeline: plain msgspec Structs, free of torch.

Every section rejects unknown fields and checks its values in ``__post_init__``, so a bad
config fails at start with the offending key, long before a model is built. The app composes
these sections into its command configs and loads them from TOML.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from tandem.agent_env import SandboxError, check_task_family

CATEGORY_KEYS = ("function", "bug_kind")
"""The metadata fields that name a generated task's category (its function and bug kind)."""


class ConfigValueError(ValueError):
    """A config value is out of range; the message names the field and the allowed values."""


def _require(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ConfigValueError(f"{field}: {why}")


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Shapes of the reference MoE (Qwen3-MoE field names); the vocabulary is the tokenizer's."""

    hidden_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    moe_intermediate_size: int = 192
    num_experts: int = 4
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 4096
    kv_split_size: int = 64
    init_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        _require(
            self.num_attention_heads % max(self.num_key_value_heads, 1) == 0,
            "num_key_value_heads",
            "must divide num_attention_heads",
        )
        _require(
            0 < self.num_experts_per_tok <= self.num_experts,
            "num_experts_per_tok",
            "must be in [1, num_experts]",
        )


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Which generated tasks are used; training and held-out sets are different seeds."""

    train_seed: int = 1
    eval_seed: int = 1000
    kinds: list[str] = msgspec.field(
        default_factory=lambda: [
            "wrong_operator",
            "off_by_one",
            "wrong_constant",
            "swapped_arguments",
            "wrong_variable",
            "wrong_return",
        ]
    )
    functions_per_repo: int = 1
    hidden_per_function: int = 6
    functions: list[str] = msgspec.field(default_factory=list)
    """Template functions the bugs are drawn from (empty: all of agent-env's)."""
    modules: list[str] = msgspec.field(default_factory=list)
    """Module names the repositories use (empty: all of agent-env's)."""

    def __post_init__(self) -> None:
        _require(self.train_seed != self.eval_seed, "eval_seed", "must differ from train_seed")
        try:
            check_task_family(self.kinds, self.functions_per_repo, self.functions, self.modules)
        except SandboxError as e:
            raise ConfigValueError(str(e)) from None


class EnvSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Episode settings passed to agent-env, plus how observations are shown to the policy.

    ``partial_credit``: the reward is the fraction of hidden tests that pass instead of 1
    only when all do (pass@k still counts only resolved tasks).
    """

    max_turns: int = 6
    system_prompt: str = "Fix the bug with the tools, run the tests, then submit."
    max_observation_chars: int = 600
    allow_unsandboxed: bool = False
    grade_timeout_s: float = 60.0
    episode_wall_s: float = 300.0
    partial_credit: bool = False

    def __post_init__(self) -> None:
        _require(self.max_turns >= 1, "max_turns", "must be >= 1")
        _require(self.max_observation_chars >= 64, "max_observation_chars", "must be >= 64")


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The embedded inference engine: slots, context, sampling and weight updates.

    ``update_mid_rollout``: apply a new policy version between any two decoding steps, even
    in the middle of a turn (each token is tagged with the version that produced it); when
    false, only at a step where no turn is being generated (episodes may still span versions).
    ``stop_malformed``: end a turn at the first token after which it can no longer become a
    well-formed call of a known tool (`CallPrefix`), instead of decoding to the token budget.
    ``share_prefixes``: a turn copies the keys and values another slot already computed for
    its leading tokens at the current version instead of prefilling them (bit-exact under
    ``deterministic``; see `PrefixIndex`).
    """

    max_slots: int = 32
    max_len: int = 2048
    max_new_tokens: int = 192
    temperature: float = 1.0
    deterministic: bool = True
    update_mid_rollout: bool = True
    stop_malformed: bool = True
    share_prefixes: bool = True

    def __post_init__(self) -> None:
        _require(self.max_slots >= 1, "max_slots", "must be >= 1")
        _require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        _require(self.max_len > self.max_new_tokens, "max_len", "must exceed max_new_tokens")
        _require(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")


class LossConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The GRPO settings the RL stage exposes (mapped onto `tandem.grpo.GRPOConfig`).

    ``kl_coef`` > 0 adds a KL penalty to the frozen policy the RL run started from (the
    trainer keeps a copy). ``kl_estimator``: as a loss term, k2's gradient is the on-policy
    gradient of KL(policy || reference), which pulls the policy back; k1's only lowers the
    log-probs of the sampled tokens, and k3's is k2's to first order.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    is_mode: Literal["none", "token_tis", "token_mis", "sequence_mis", "geometric_mis"] = (
        "token_tis"
    )
    is_cap: float = 2.0
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"] = (
        "constant"
    )
    max_tokens: int = 512
    std_normalize: bool = False
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    micro_batch_size: int = 8
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        # GRPOConfig's checks of these fields, here so that they fail when the config loads
        # (this module stays free of torch, which tandem.grpo imports)
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef"):
            value = getattr(self, name)
            _require(0 <= value < float("inf"), name, "must be a finite number >= 0")
        _require(self.clip_eps_low < 1, "clip_eps_low", "must be < 1")
        _require(0 < self.is_cap < float("inf"), "is_cap", "must be a finite number > 0")
        _require(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        _require(self.max_grad_norm > 0, "max_grad_norm", "must be > 0")


class TrainerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Optimizer and replay of the RL trainer.

    ``replay``: R3 replays the experts the engine used, R2 the trainer's own no-grad pass,
    ``none`` lets the trainer route freely. ``routing_check_rows``: rows per step re-run
    without replay to measure routing agreement without it (0 disables the extra pass).
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
    per step (one published version), so staleness keeps its meaning.
    """

    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: list[float] = msgspec.field(default_factory=lambda: [0.9, 0.99])
    replay: Literal["R3", "R2", "none"] = "R3"
    routing_check_rows: int = 4
    processes: int = 1
    parallel: Literal["ddp", "fsdp"] = "fsdp"
    share_prefixes: bool = True
    updates_per_step: int = 1
    loss: LossConfig = msgspec.field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        _require(self.lr > 0, "lr", "must be > 0")
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
    (see `tandem.orchestrator.priority`); -1 keeps the value Ray gives.
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


class CurriculumConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Passing over tasks of categories that give GRPO no signal (see `SaturationFilter`).

    A task's category is the values of its ``keys`` metadata fields (generated tasks carry
    ``function``, ``bug_kind`` and ``mutation``). A category is saturated when its last
    ``window`` groups each had one reward for every sample (all solved or all failed); only a
    ``keep`` fraction of its tasks is then played, so it is still watched as the policy
    changes. Off by default: every task at the cursor is played.
    """

    enabled: bool = False
    keys: list[str] = msgspec.field(default_factory=lambda: list(CATEGORY_KEYS))
    window: int = 3
    keep: float = 0.2

    def __post_init__(self) -> None:
        _require(len(self.keys) >= 1, "keys", "must name at least one metadata field")
        _require(self.window >= 1, "window", "must be >= 1")
        _require(0 < self.keep <= 1, "keep", "must be in (0, 1] (0 would never look again)")


class RLConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The asynchronous (or synchronous) GRPO stage.

    ``mode``: ``async`` overlaps rollouts and training; ``sync`` alternates them (max_staleness
    is then 0 by construction); ``pipelined`` overlaps them in lock step: step k+1's groups
    play on version k (every engine on it, none swapping mid-group) while the trainer trains
    step k on groups of version k-1, so staleness is exactly 1 (0 in the first two steps)
    and the run depends only on its seeds, not on timing or the number of engines.
    ``max_staleness``: a group produced by policy version v is
    trained on only while trainer_version - v <= max_staleness. ``rollout_workers``: groups in
    flight at once. ``max_ahead``: how many trainer steps rollouts may start ahead
    (0: max_staleness + 1, the bound that keeps drops rare). ``backend``: where the engines
    run, ``local`` (one in this process) or ``ray`` (rollout actors, see `RayConfig`).
    ``curriculum``: which tasks at the cursor are played (`CurriculumConfig`).
    ``torch_threads``: torch's CPU threads in this process while the stage runs (0: torch's
    default; Ray actors have ``ray.torch_threads``). With the local backend the engine and the
    trainer are two threads of this process: on a 2-core machine 1 lets each have a core.
    """

    mode: Literal["async", "sync", "pipelined"] = "async"
    backend: Literal["local", "ray"] = "local"
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
    eval_tasks: int = 32
    eval_samples: int = 1
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    curriculum: CurriculumConfig = msgspec.field(default_factory=CurriculumConfig)

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "steps", "must be >= 1")
        _require(self.group_size >= 2, "group_size", "must be >= 2 (GRPO compares samples)")
        _require(self.groups_per_step >= 1, "groups_per_step", "must be >= 1")
        _require(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        _require(self.rollout_workers >= 1, "rollout_workers", "must be >= 1")
        _require(self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
        _require(self.max_ahead >= 0, "max_ahead", "must be >= 0 (0: max_staleness + 1)")
        _require(self.torch_threads >= 0, "torch_threads", "must be >= 0 (0: torch's default)")

    @property
    def effective_max_ahead(self) -> int:
        if self.mode != "async":
            return 1
        return self.max_ahead or self.max_staleness + 1


class MidtrainConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Next-token training on standard-library code and oracle transcripts.

    ``transcripts``: oracle episodes on generated training tasks (rendered in the chat and
    tool-call format); ``transcript_fraction``: share of each batch's sequences that are
    transcripts (the rest are packed code windows of ``window`` tokens);
    ``transcript_loss``: ``all`` tokens of a transcript or only the ``assistant`` turns.
    ``skip_tools``: read-only calls left out of the transcripts (see `condense`).
    ``edit_min_chars``: the oracle's edits are narrowed to the shortest unique text around the
    change that is at least this long (see `minimal_edit`).
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
    code_bytes: int = 4_000_000
    log_every: int = 10

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "steps", "must be >= 1")
        _require(self.batch_size >= 1, "batch_size", "must be >= 1")
        _require(0 <= self.transcript_fraction <= 1, "transcript_fraction", "must be in [0, 1]")
        _require(self.lr > 0, "lr", "must be > 0")
        _require(self.edit_min_chars >= 1, "edit_min_chars", "must be >= 1")
