"""What `delta-sync` prints: one rich Console for progress bars, messages and log lines.

Log events go through the same console as the bars, so while a live display is up they
are printed above it instead of into it. Output that is not a terminal (a file, a pipe,
CI logs) is never wrapped: a message is one line however long its paths are, and log
events are JSON lines there (readable key=value lines on a terminal).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import IO

import structlog
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

NOT_A_TERMINAL_WIDTH = 1 << 16  # wide enough that no line is ever wrapped


def make_console(*, stderr: bool = True, file: IO[str] | None = None) -> Console:
    """A console that wraps nothing: soft wrap on a terminal, no width limit off one."""
    opts = {"file": file, "stderr": stderr, "soft_wrap": True, "highlight": False}
    opts |= {"markup": False, "emoji": False}  # paths and messages are printed as they are
    console = Console(**opts)
    if not console.is_terminal:
        console = Console(**opts, width=NOT_A_TERMINAL_WIDTH)
    return console


class ConsoleLogger:
    """A structlog logger that prints each rendered event through a rich console."""

    def __init__(self, console: Console) -> None:
        self._console = console

    def msg(self, message: str) -> None:
        self._console.print(Text.from_ansi(message), soft_wrap=True)

    log = debug = info = warn = warning = error = err = critical = exception = fatal = msg


def configure_logging(console: Console, level: int = logging.INFO) -> None:
    """Route structlog events through `console` (the CLI is the application: it may)."""
    if console.is_terminal:
        renderer: Callable = structlog.dev.ConsoleRenderer(colors=console.color_system is not None)
        tail: list[Callable] = []
    else:
        renderer = structlog.processors.JSONRenderer()
        tail = [structlog.processors.format_exc_info]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.TimeStamper(fmt="iso"),
            *tail,
            renderer,
        ],
        logger_factory=lambda *_: ConsoleLogger(console),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=False,
    )


@contextmanager
def transfer_progress(
    console: Console, totals: Mapping[str, int | None] | None = None
) -> Iterator[Callable[[str, int], None]]:
    """Yields a callback (phase, nbytes). Each phase gets its bar on its first bytes (so no
    bar sits at 0 for a phase that never runs); one without a known total in `totals` is
    shown full at the end, at what was done."""
    totals = dict(totals or {})
    with Progress(
        TextColumn("{task.description:>8}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as bar:
        tasks: dict[str, int] = {}
        lock = threading.Lock()

        def advance(phase: str, n: int) -> None:
            with lock:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=totals.get(phase))
                bar.advance(tasks[phase], n)

        try:
            yield advance
        finally:
            for task in bar.tasks:
                if task.total is None:
                    bar.update(task.id, total=task.completed)
