"""structlog configuration: JSON lines for machines (journald), a readable console for people."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", stream: TextIO | None = None, json: bool | None = None) -> None:
    """Route every structlog event at `level` or above to `stream` (stdout by default).

    json=None picks JSON unless the stream is a terminal.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {sorted(LEVELS)}, got {level!r}")
    stream = stream or sys.stdout
    if json is None:
        json = not stream.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
