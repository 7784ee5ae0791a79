"""structlog set-up: configured once per process, re-levelled on SIGHUP.

- JSON lines on stdout when it is not a terminal (under systemd, journald
  keeps each line whole and ``journalctl -o cat | jq`` reads them); readable
  console output when a terminal is attached. ``[log] format`` forces either.
- ``merge_contextvars`` puts ``core``, ``lsn``, ``batch_id`` (bound with
  ``structlog.contextvars.bound_contextvars``) on every event of a task.
- Timestamps are ISO 8601 UTC.
- Records from libraries on stdlib ``logging`` (aiohttp, py4j, pyspark) are
  rendered by the same renderer to the same stream, at WARNING and above.
- :func:`install_hooks` (the daemon calls it once) turns what Python would
  print as plain text into one event each: uncaught exceptions of the main
  thread (``sys.excepthook``), of other threads (``threading.excepthook``),
  exceptions nobody could raise (``sys.unraisablehook``), exceptions the event
  loop caught (:func:`loop_exception_handler`) and warnings
  (``warnings.showwarning``). A traceback is one ``exception`` field.
- Event names are ``<area>.<what_happened>`` (docs/operating.md, "Logs").

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

import asyncio
import logging
import sys
import threading
import warnings
from collections.abc import MutableMapping
from types import TracebackType
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
# "json" or "console": what configure() chose (``auto`` resolved).
_format = "console"
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
    global _level, _root_level_before, _format
    out = sys.stdout if stream is None else stream
    tty = _isatty(out)
    use_json = fmt == "json" or (fmt == "auto" and not tty)
    _level = LEVELS[level]
    _format = "json" if use_json else "console"

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


def current_format() -> str:
    """``json`` or ``console``: what configure() chose (the Spark JVM log follows it)."""
    return _format


def reset() -> None:
    """Undo configure() (for tests): structlog's default processors and output,
    our stdlib handler removed. Loggers cached meanwhile follow, because the
    processor list and the output proxy are changed in place."""
    global _level, _root_level_before, _format
    uninstall_hooks()
    _level = logging.INFO
    _format = "console"
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


# -- what Python would otherwise print as plain text ----------------------------

_process_log = structlog.get_logger("eventplane.process")
# The hooks install_hooks() replaced, restored by uninstall_hooks().
_saved_hooks: dict[str, Any] = {}


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    if issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C outside the loop: no traceback
        return
    _process_log.critical(
        "process.uncaught_exception",
        thread=threading.current_thread().name,
        error=f"{exc_type.__name__}: {exc}",
        exc_info=(exc_type, exc, tb),
    )


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # what threading's default hook ignores too
        return
    _process_log.error(
        "process.thread_exception",
        thread=args.thread.name if args.thread is not None else None,
        error=f"{args.exc_type.__name__}: {args.exc_value}",
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def _unraisablehook(args: Any) -> None:
    # args is sys.UnraisableHookArgs (not importable as a type).
    exc = args.exc_value
    _process_log.error(
        "process.unraisable_exception",
        message=args.err_msg or "Exception ignored in",
        object=repr(args.object),
        error=f"{args.exc_type.__name__}: {exc}",
        exc_info=(args.exc_type, exc, args.exc_traceback) if exc is not None else None,
    )


def _showwarning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    _process_log.warning(
        "process.warning",
        category=category.__name__,
        message=str(message),
        filename=filename,
        lineno=lineno,
    )


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """``loop.set_exception_handler``: what the loop caught (a task's exception
    nobody retrieved, a failing callback) as one event."""
    exc = context.get("exception")
    where = context.get("task") or context.get("future") or context.get("handle")
    _process_log.error(
        "process.loop_exception",
        message=context.get("message", "unhandled exception in the event loop"),
        where=repr(where) if where is not None else None,
        error=f"{type(exc).__name__}: {exc}" if exc is not None else None,
        exc_info=exc,
    )


def install_hooks() -> None:
    """Route uncaught exceptions and warnings through structlog (once per process).

    The event loop's handler is per loop: the daemon sets
    :func:`loop_exception_handler` on its loop itself.
    """
    if _saved_hooks:
        return
    _saved_hooks.update(
        excepthook=sys.excepthook,
        thread_excepthook=threading.excepthook,
        unraisablehook=sys.unraisablehook,
        showwarning=warnings.showwarning,
    )
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    sys.unraisablehook = _unraisablehook
    warnings.showwarning = _showwarning


def uninstall_hooks() -> None:
    """Undo :func:`install_hooks` (reset() calls it, for tests)."""
    if not _saved_hooks:
        return
    sys.excepthook = _saved_hooks.pop("excepthook")
    threading.excepthook = _saved_hooks.pop("thread_excepthook")
    sys.unraisablehook = _saved_hooks.pop("unraisablehook")
    warnings.showwarning = _saved_hooks.pop("showwarning")
