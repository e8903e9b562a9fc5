"""What the RL loop shows per step: one structlog line and a rich progress bar."""

from __future__ import annotations

from typing import Any

import structlog

log = structlog.get_logger()


def log_step(step: int, stats: dict[str, Any]) -> None:
    def r(key: str, nd: int = 3) -> Any:
        v = stats.get(key)
        return round(v, nd) if isinstance(v, float) else v

    log.info(
        "rl.step",
        step=step,
        version=stats.get("policy_version"),
        reward=r("reward"),
        pass_rate=r("pass_rate"),
        loss=r("loss", 4),
        entropy=r("entropy"),
        # the KL penalty's, to the start policy (the metric reads 0 when there is no penalty)
        kl=r("kl", 4) or None,
        kl_to_start=r("kl_to_start_k3", 4),
        category_reward={
            c: row["reward"] for c, row in (stats.get("category_reward") or {}).items()
        },
        category_weight=stats.get("category_weight"),
        mismatch_max=stats.get("mismatch_max_abs"),
        routing_free=r("routing_agreement_free", 4),
        staleness=stats.get("staleness_histogram"),
        dropped=stats.get("dropped_stale"),
        filtered=stats.get("groups_filtered_equal"),
        skipped=stats.get("tasks_skipped"),
        sync_kb=round(stats["sync_bytes"] / 1024, 1) if stats.get("sync_bytes") else None,
        train_s=r("train_s", 2),
        wait_s=r("wait_s", 2),
    )


class StepProgress:
    """A rich progress bar over RL steps (silent when disabled)."""

    def __init__(self, total: int, done: int, *, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]RL"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(stderr=True),
            )
            self._bar.start()
            self._task = self._bar.add_task("rl", total=total, completed=done, info="")

    def advance(self, stats: dict[str, Any]) -> None:
        if self._bar is not None:
            info = f"reward {stats.get('reward', 0):.2f} pass {stats.get('pass_rate', 0):.2f}"
            self._bar.update(self._task, advance=1, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
