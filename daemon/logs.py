"""structlog set-up: configured once per process, re-levelled on SIGHUP.

- JSON lines on stdout when it is not a terminal (under systemd, journald
  keeps each line whole and ``journalctl -o cat | jq`` reads them); readable
  console output when a terminal is attached. ``[log] format`` forces either.
- ``merge_contextvars`` puts ``core``, ``lsn``, ``batch_id`` (bound with
  ``structlog.contextvars.bound_contextvars``) on every event of a task.
- Timestamps are ISO 8601 UTC.
- Records from libraries on stdlib ``logging`` (aiohttp, py4j) are rendered
  by the same renderer to the same stream, at WARNING and above.

The level is applied by a processor that reads a module variable rather than
by structlog's filtering wrapper: with ``cache_logger_on_first_use`` a logger
freezes its wrapper on first use, so a SIGHUP could otherwise never lower or
raise the level of module-level loggers already in use.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog
from structlog.types import Processor

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
# structlog method names -> numeric level; unknown names (msg, log) always pass.
_METHOD_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}
# Library chatter (py4j's connection notices, aiohttp's access lines) stays out below this.
_LIBRARY_MIN_LEVEL = logging.WARNING

_level = logging.INFO


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the stdlib handler we installed, so configure() can replace only ours."""


def _filter_by_level(
    _logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    if _METHOD_LEVELS.get(method_name, logging.CRITICAL) < _level:
        raise structlog.DropEvent
    return event_dict


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False


def configure(level: str = "info", fmt: str = "auto", *, stream: TextIO | None = None) -> None:
    """Configure structlog (and the stdlib bridge) for this process.

    ``fmt``: ``json``, ``console`` or ``auto`` (console when ``stream`` is a
    terminal). ``stream`` defaults to ``sys.stdout``; tests pass their own.
    """
    global _level
    out = sys.stdout if stream is None else stream
    tty = _isatty(out)
    use_json = fmt == "json" or (fmt == "auto" and not tty)
    _level = LEVELS[level]

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Processor
    tail: list[Processor]
    if use_json:
        renderer = structlog.processors.JSONRenderer()
        # One string field keeps a traceback greppable in journalctl.
        tail = [structlog.processors.format_exc_info, renderer]
    else:
        # ConsoleRenderer formats exceptions itself (format_exc_info would warn).
        renderer = structlog.dev.ConsoleRenderer(colors=tty)
        tail = [renderer]

    structlog.configure(
        processors=[_filter_by_level, *shared, *tail],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=True,
    )

    handler = _Handler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *tail,
            ],
        )
    )
    root = logging.getLogger()
    _remove_handler(root)
    root.addHandler(handler)
    root.setLevel(max(_LIBRARY_MIN_LEVEL, _level))


def set_level(level: str) -> None:
    """Change the level at run time (SIGHUP reload); affects loggers already in use."""
    global _level
    _level = LEVELS[level]
    logging.getLogger().setLevel(max(_LIBRARY_MIN_LEVEL, _level))


def current_level() -> str:
    return next(name for name, value in LEVELS.items() if value == _level)


def reset() -> None:
    """Undo configure(): structlog defaults, our stdlib handler removed (for tests)."""
    global _level
    _level = logging.INFO
    structlog.reset_defaults()
    _remove_handler(logging.getLogger())


def _remove_handler(root: logging.Logger) -> None:
    for h in list(root.handlers):
        if isinstance(h, _Handler):
            root.removeHandler(h)
