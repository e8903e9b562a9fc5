"""structlog setup, done once by the app: console rendering on a TTY, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Configure structlog (and stdlib logging) for this process.

    ``fmt`` is ``"console"``, ``"json"`` or ``"auto"`` (console when ``stream`` is a TTY).
    Libraries only call ``structlog.get_logger()``; this is the single place that decides how
    their events are rendered.
    """
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    numeric = logging.getLevelNamesMapping()[level.upper()]
    renderer: structlog.typing.Processor
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=numeric, stream=stream, format="%(levelname)s %(name)s: %(message)s", force=True
    )
    # the HTTP clients log every request at INFO (thousands per run with a vLLM engine)
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(numeric, logging.WARNING))
