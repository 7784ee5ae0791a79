"""structlog set-up: JSON off a terminal, console on one, context, live level."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import sys
import threading
import types
import warnings
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from daemon.service import logs
from daemon.spark import session

pytestmark = pytest.mark.usefixtures("clean_logging")


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(stream: io.StringIO) -> list[str]:
    return [line for line in stream.getvalue().splitlines() if line]


def test_json_lines_when_stdout_is_not_a_terminal() -> None:
    out = io.StringIO()
    logs.configure("info", "auto", stream=out)
    structlog.get_logger("t").info("wal.opened", head_lsn=42, dir="var/wal")
    (line,) = _lines(out)
    record = json.loads(line)
    assert record["event"] == "wal.opened"
    assert record["level"] == "info"
    assert record["head_lsn"] == 42
    # ISO 8601 in UTC, as journald and log shippers expect.
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", record["timestamp"])


def test_readable_console_lines_on_a_terminal() -> None:
    out = FakeTty()
    logs.configure("info", "auto", stream=out)
    structlog.get_logger("t").info("eventplane.ready", cores=4)
    (line,) = _lines(out)
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", line)  # colours on a terminal
    assert "eventplane.ready" in plain
    assert "cores=4" in plain


@pytest.mark.parametrize(
    ("fmt", "tty", "is_json"), [("json", True, True), ("console", False, False)]
)
def test_the_format_setting_overrides_detection(fmt: str, tty: bool, is_json: bool) -> None:
    out = FakeTty() if tty else io.StringIO()
    logs.configure("info", fmt, stream=out)
    structlog.get_logger("t").info("x")
    (line,) = _lines(out)
    assert line.startswith("{") is is_json


async def test_core_lsn_and_batch_id_bound_as_context_reach_every_event() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    log = structlog.get_logger("t")
    with structlog.contextvars.bound_contextvars(core=3, batch_id=17):
        with structlog.contextvars.bound_contextvars(lsn=1234):
            log.info("batch.slice_closed")
        log.info("batch.committed")
    log.info("idle")
    first, second, third = (json.loads(x) for x in _lines(out))
    assert (first["core"], first["batch_id"], first["lsn"]) == (3, 17, 1234)
    assert (second["core"], second["batch_id"]) == (3, 17) and "lsn" not in second
    assert "core" not in third


def test_set_level_applies_to_loggers_already_in_use() -> None:
    """1. A module-level style logger is used once (structlog caches it).
    2. SIGHUP lowers the level to debug: its debug events now appear.
    3. Raising it to warning hides info events of the same cached logger."""
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    log = structlog.get_logger("t")
    log.info("first")
    log.debug("hidden")
    logs.set_level("debug")
    log.debug("now-visible")
    logs.set_level("warning")
    log.info("hidden-again")
    log.warning("kept")
    assert [json.loads(x)["event"] for x in _lines(out)] == ["first", "now-visible", "kept"]
    assert logs.current_level() == "warning"


def test_exceptions_are_one_json_field() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    try:
        raise ValueError("bad frame")
    except ValueError:
        structlog.get_logger("t").exception("wal.replay_failed")
    record = json.loads(_lines(out)[0])
    assert record["level"] == "error"
    assert "ValueError: bad frame" in record["exception"]


def test_stdlib_library_warnings_share_the_format_and_stream() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    logging.getLogger("py4j.clientserver").info("Closing down clientserver connection")
    logging.getLogger("aiohttp.server").warning("Error handling request")
    (line,) = _lines(out)
    record = json.loads(line)
    assert record["event"] == "Error handling request"
    assert record["logger"] == "aiohttp.server"
    assert record["level"] == "warning"


def test_capture_logs_still_sees_loggers_cached_before_reset() -> None:
    """A logger cached under configure() keeps working with capture_logs after
    reset(): no state leaks from one test into the next."""
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    log = structlog.get_logger("t")
    log.info("cached")
    logs.reset()
    with capture_logs() as captured:
        log.info("after-reset", core=1)
    assert captured == [{"event": "after-reset", "core": 1, "log_level": "info"}]
    assert len(_lines(out)) == 1


def test_configure_twice_keeps_one_stdlib_handler() -> None:
    logs.configure("info", "json", stream=io.StringIO())
    logs.configure("info", "json", stream=io.StringIO())
    ours = [h for h in logging.getLogger().handlers if isinstance(h, logs._Handler)]
    assert len(ours) == 1


def test_current_format_resolves_auto() -> None:
    logs.configure("info", "auto", stream=io.StringIO())
    assert logs.current_format() == "json"
    logs.configure("info", "auto", stream=FakeTty())
    assert logs.current_format() == "console"


def _boom() -> None:
    raise ValueError("bad frame")


def test_an_uncaught_exception_is_one_event_with_its_traceback() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    logs.install_hooks()
    try:
        _boom()
    except ValueError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    (line,) = _lines(out)
    record = json.loads(line)
    assert record["event"] == "process.uncaught_exception"
    assert record["level"] == "critical"
    assert record["error"] == "ValueError: bad frame"
    assert record["exception"].startswith("Traceback (most recent call last)")
    assert "in _boom" in record["exception"]


def test_an_exception_that_ends_a_thread_is_one_event() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    logs.install_hooks()
    t = threading.Thread(target=_boom, name="worker-7")
    t.start()
    t.join()
    (line,) = _lines(out)
    record = json.loads(line)
    assert (record["event"], record["thread"]) == ("process.thread_exception", "worker-7")
    assert "ValueError: bad frame" in record["exception"]


def test_a_warning_is_one_event() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        logs.install_hooks()
        warnings.warn("old API", DeprecationWarning, stacklevel=1)
    (line,) = _lines(out)
    record = json.loads(line)
    assert record["event"] == "process.warning"
    assert (record["category"], record["message"]) == ("DeprecationWarning", "old API")
    assert record["filename"] == __file__ and record["level"] == "warning"


async def test_an_exception_only_the_loop_saw_is_one_event() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(logs.loop_exception_handler)
    try:
        _boom()
    except ValueError as exc:
        error = exc
    loop.call_exception_handler(
        {"message": "Task exception was never retrieved", "exception": error}
    )
    (line,) = _lines(out)
    record = json.loads(line)
    assert record["event"] == "process.loop_exception"
    assert record["message"] == "Task exception was never retrieved"
    assert "ValueError: bad frame" in record["exception"]


def test_an_unraisable_exception_is_one_event() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    logs.install_hooks()
    exc = ValueError("in __del__")
    sys.unraisablehook(
        types.SimpleNamespace(exc_type=ValueError, exc_value=exc, exc_traceback=None,
                              err_msg="Exception ignored in", object=_boom)
    )  # fmt: skip
    (line,) = _lines(out)
    record = json.loads(line)
    assert record["event"] == "process.unraisable_exception"
    assert record["error"] == "ValueError: in __del__"


def test_reset_restores_the_hooks_it_replaced() -> None:
    before = (sys.excepthook, threading.excepthook, sys.unraisablehook, warnings.showwarning)
    logs.configure("info", "json", stream=io.StringIO())
    logs.install_hooks()
    assert sys.excepthook is not before[0]
    logs.reset()
    after = (sys.excepthook, threading.excepthook, sys.unraisablehook, warnings.showwarning)
    assert after == before


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_the_spark_jvm_logs_in_the_daemon_format(fmt: str) -> None:
    conf = session.effective_conf("local[1]", "warn", {}, ui=False, log_format=fmt)
    path = conf["spark.driver.extraJavaOptions"].split()[0].split("file:", 1)[1]
    text = Path(path).read_text()
    assert text == session.log4j2_text("warn", fmt)
    assert "rootLogger.level = WARN" in text
    layout = {k.strip(): v.strip() for k, v in (x.split("=", 1) for x in text.splitlines()
              if x.startswith("appender.stderr.layout."))}  # fmt: skip
    if fmt == "console":
        assert layout["appender.stderr.layout.type"] == "PatternLayout"
        return
    assert layout["appender.stderr.layout.type"] == "JsonTemplateLayout"
    template = json.loads(layout["appender.stderr.layout.eventTemplate"])
    # The daemon's own field names, so one jq filter reads both.
    assert {"timestamp", "level", "event", "logger", "exception"} <= template.keys()
    assert template["exception"]["stackTrace"] == {"stringified": True}
