"""What an episode does when its context fills: end, slide, or summarise and go on."""

from __future__ import annotations

from typing import Literal

import msgspec

from tandem.orchestrator.config_checks import require as _require

DEFAULT_INSTRUCTION = (
    "Your context is full. Write a short summary of your work so far: what the task is, "
    "what you found, what you changed and what is left to do. Write no tool call."
)


class CompactionConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Long episodes (``[episode.compaction]``); `tandem.orchestrator.rollout.compaction`.

    ``mode``: ``none``, the episode ends when the engine's window is full
    (``context_limit``); ``sliding``, the episode goes on in a fresh context holding the
    prompt and the most recent turns that fit in ``keep_fraction`` of the window;
    ``summary``, the policy is asked (``instruction``, a user turn in its own chat format) to
    summarise its context, and the episode goes on in a fresh context: the system prompt, the
    task, the summary and, with ``keep_last_observation``, the last tool output.

    ``trigger``: the fraction of ``engine.max_len`` at which a context is compacted (checked
    before each tool output is added). ``summary_max_tokens``: a summary's own budget; one
    cut there is kept and counted (``summaries_cut``). ``train_summary``: whether the
    summary's tokens are in the loss (trained by the episode's reward like every sampled
    token) or masked out of it (a prompted summary that RL does not shape).
    """

    mode: Literal["none", "sliding", "summary"] = "none"
    trigger: float = 0.75
    summary_max_tokens: int = 256
    instruction: str = DEFAULT_INSTRUCTION
    keep_last_observation: bool = True
    train_summary: bool = True
    keep_fraction: float = 0.5

    def __post_init__(self) -> None:
        _require(
            0.0 < self.trigger < 1.0,
            "trigger",
            f"{self.trigger} is a fraction of engine.max_len, and must be above 0 and "
            "below 1 (at or above the window the context would be full before it compacts)",
        )
        _require(self.summary_max_tokens >= 1, "summary_max_tokens", "must be >= 1")
        _require(bool(self.instruction.strip()), "instruction", "must not be empty")
        _require(
            0.0 < self.keep_fraction < (self.trigger if self.mode == "sliding" else 1.0),
            "keep_fraction",
            f"{self.keep_fraction} must be above 0 and below the trigger {self.trigger} "
            "(a window that slid to it would slide again at once)",
        )

    def trigger_tokens(self, max_len: int) -> int:
        """The context length (tokens) at which a context is compacted."""
        return int(self.trigger * max_len)

    def check_window(self, max_len: int, field: str = "episode.compaction") -> None:
        """The limits against the engine's window (``engine.max_len``), one line each.

        A summary is asked for at the trigger, so the trigger, the instruction (at most one
        token per UTF-8 byte plus the turn markers) and the summary's budget must fit in the
        window together."""
        if self.mode != "summary":
            return
        _require(
            self.summary_max_tokens < max_len,
            f"{field}.summary_max_tokens",
            f"{self.summary_max_tokens} is at or above the window (engine.max_len = {max_len})",
        )
        need = self.trigger_tokens(max_len) + len(self.instruction.encode()) + 16
        _require(
            need + self.summary_max_tokens <= max_len,
            f"{field}.trigger",
            f"a summary asked for at {self.trigger_tokens(max_len)} tokens needs up to "
            f"{need - self.trigger_tokens(max_len)} tokens of instruction and "
            f"{self.summary_max_tokens} of summary: more than the window "
            f"(engine.max_len = {max_len}); lower the trigger or summary_max_tokens",
        )
