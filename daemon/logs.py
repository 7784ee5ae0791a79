"""structlog set-up: configured once per process.

JSON lines on stdout when not on a terminal (journald keeps them whole),
readable console output on a terminal. ``merge_contextvars`` lets tasks bind
``core``, ``lsn`` and ``batch_id``; timestamps are ISO 8601 UTC.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "auto") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stdout.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
    # Libraries that use stdlib logging (aiohttp, py4j) go to stderr at WARNING.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def set_level(level: str) -> None:
    """Change the level at run time (SIGHUP reload)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
                        cache_logger_on_first_use=False)
