"""structlog set-up: configured once per process, re-levelled on SIGHUP.

- JSON lines on stdout when it is not a terminal (under systemd, journald
  keeps each line whole and ``journalctl -o cat | jq`` reads them); readable
  console output when a terminal is attached. ``[log] format`` forces either.
- ``merge_contextvars`` puts ``core``, ``lsn``, ``batch_id`` (bound with
  ``structlog.contextvars.bound_contextvars``) on every event of a task.
- Timestamps are ISO 8601 UTC.
- Records from libraries on stdlib ``logging`` (aiohttp, py4j) are rendered
  by the same renderer to the same stream, at WARNING and above.

With ``cache_logger_on_first_use`` a logger freezes, on first use, its
wrapper class, its processor list object and its output. So that neither a
SIGHUP nor a test's re-configuration is lost on loggers already in use:

- the level is a processor reading a module variable, not structlog's
  filtering wrapper (a SIGHUP could otherwise never change the level of
  module-level loggers already used);
- the processor list is one list object, changed in place (as
  ``structlog.testing.capture_logs`` does);
- output goes through a small proxy whose target stream can be swapped.
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
# The one processor list every structlog logger of the process refers to.
_PROCESSORS: list[Processor] = []
# The stdlib root level before configure(), restored by reset().
_root_level_before: int | None = None


class _Output:
    """The stream loggers write to; configure() and reset() retarget it.

    None means whatever ``sys.stdout`` is at the time of the write.
    """

    def __init__(self) -> None:
        self.stream: TextIO | None = None

    def _target(self) -> TextIO:
        return sys.stdout if self.stream is None else self.stream

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()


_OUTPUT = _Output()


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
    global _level, _root_level_before
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

    _OUTPUT.stream = stream
    _PROCESSORS[:] = [_filter_by_level, *shared, *tail]
    structlog.configure(
        processors=_PROCESSORS,
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(_OUTPUT),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )

    handler = _Handler(_OUTPUT)
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
    if _root_level_before is None:
        _root_level_before = root.level
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
    """Undo configure() (for tests): structlog's default processors and output,
    our stdlib handler removed. Loggers cached meanwhile follow, because the
    processor list and the output proxy are changed in place."""
    global _level, _root_level_before
    _level = logging.INFO
    _OUTPUT.stream = None
    structlog.reset_defaults()
    _PROCESSORS[:] = structlog.get_config()["processors"]
    structlog.configure(processors=_PROCESSORS)
    root = logging.getLogger()
    _remove_handler(root)
    if _root_level_before is not None:
        root.setLevel(_root_level_before)
        _root_level_before = None


def _remove_handler(root: logging.Logger) -> None:
    for h in list(root.handlers):
        if isinstance(h, _Handler):
            root.removeHandler(h)
