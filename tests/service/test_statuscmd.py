"""``eventplane status`` against a real HTTP server speaking the /v1/status contract."""

from __future__ import annotations

import argparse
import io
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from daemon.cli import status as statuscmd
from daemon.cli.main import build_parser
from daemon.config import AdminConfig, Config, Listen
from tests.conftest import free_port

COMMITTED_AT = "2025-03-01T12:00:00Z"
NOW = datetime(2025, 3, 1, 12, 0, 42, tzinfo=UTC).timestamp()


def sample_status(**overrides: Any) -> dict[str, Any]:
    """A /v1/status document as docs/operating.md specifies it."""
    doc: dict[str, Any] = {
        "healthy": True,
        "ready": True,
        "draining": False,
        "wal": {"head_lsn": 1_204_332, "retained_floor": 1_000_001, "segments": 3},
        "cores": [
            {
                "core": 0,
                "mode": "normal",
                "watermark": 1_204_330,
                "lag": 2,
                "ring_fill": 0.004,
                "backpressure": "normal",
                "catchup": None,
            },
            {
                "core": 1,
                "mode": "catchup",
                "watermark": 1_100_000,
                "lag": 104_332,
                "ring_fill": 0.0,
                "backpressure": "normal",
                "catchup": {"replayed": 395_668, "rate": 52_000.4, "eta_s": 2.0},
            },
        ],
        "last_batch": {
            "batch_id": 812,
            "rows": 12_000,
            "duration_s": 0.84,
            "committed_at": COMMITTED_AT,
        },
        "spark": {"ready": True, "last_error": None},
        "dlq": {"entries": 3},
        "retry_queue": {"depth": 1},
    }
    doc.update(overrides)
    return doc


class StatusServer:
    """A real admin listener on loopback answering GET /v1/status."""

    def __init__(self) -> None:
        self.code = 200
        self.body = json.dumps(sample_status()).encode()
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.paths.append(self.path)
                self.send_response(outer.code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self.thread.start()

    def serve(self, doc: Any, code: int = 200) -> None:
        self.body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        self.code = code

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[StatusServer]:
    s = StatusServer()
    yield s
    s.close()


def _cfg(port: int, host: str = "127.0.0.1") -> Config:
    return Config(admin=AdminConfig(listen=Listen(host, port)))


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["status", *argv])


def test_healthy_daemon_prints_the_table_and_exits_zero(
    server: StatusServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert statuscmd.main(_args(), _cfg(server.port)) == 0
    out = capsys.readouterr().out
    assert server.paths == ["/v1/status"]  # the URL comes from admin.listen
    assert "eventplane  healthy, ready" in out
    assert "head 1204332  floor 1000001  segments 3" in out
    assert "#812  12,000 rows  0.84 s  committed 2025-03-01 12:00:00Z" in out
    assert "DLQ 3 entries  retry queue 1" in out
    assert "replayed 395,668 at 52,000/s, ETA 2 s" in out


def test_table_has_one_aligned_row_per_core() -> None:
    text = statuscmd.render(sample_status(), now=NOW)
    table = text.split("\n\n", 1)[1].splitlines()
    header, core0, core1 = table
    assert header.split()[:6] == ["core", "mode", "watermark", "lag", "ring", "fill"]
    assert core0.split()[:6] == ["0", "normal", "1204330", "2", "0.4%", "normal"]
    assert core1.split()[:6] == ["1", "catchup", "1100000", "104,332", "0.0%", "normal"]
    # Right-aligned numbers end in the same column as their header.
    assert header.index("watermark") + len("watermark") == core0.index("1204330") + 7
    assert "committed 2025-03-01 12:00:00Z (42 s ago)" in text


def test_unhealthy_daemon_exits_one_even_when_served_with_503(
    server: StatusServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.serve(
        sample_status(healthy=False, spark={"ready": False, "last_error": "JVM died"}), 503
    )
    assert statuscmd.main(_args(), _cfg(server.port)) == 1
    out = capsys.readouterr().out
    assert "NOT HEALTHY" in out
    assert "last error: JVM died" in out


def test_unreachable_daemon_exits_three_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert statuscmd.main(_args(), _cfg(free_port())) == 3
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:" in err
    assert "systemctl status eventplane" in err


def test_json_flag_prints_the_document_itself(
    server: StatusServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert statuscmd.main(_args("--json"), _cfg(server.port)) == 0
    assert json.loads(capsys.readouterr().out) == sample_status()


def test_json_flag_keeps_the_unhealthy_exit_code(
    server: StatusServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.serve(sample_status(healthy=False))
    assert statuscmd.main(_args("--json"), _cfg(server.port)) == 1
    assert json.loads(capsys.readouterr().out)["healthy"] is False


def test_url_flag_overrides_the_config(
    server: StatusServer, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args("--url", f"127.0.0.1:{server.port}/")
    assert statuscmd.main(args, _cfg(free_port())) == 0
    assert server.paths == ["/v1/status"]


def test_an_answer_that_is_not_a_status_document_exits_one(
    server: StatusServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.serve(b"<html>proxy error</html>", 502)
    assert statuscmd.main(_args(), _cfg(server.port)) == 1
    assert "without a JSON status document" in capsys.readouterr().err


def test_an_error_document_is_reported_with_the_daemons_message(
    server: StatusServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.serve({"error": "status_failed", "message": "status failed: KeyError 'wal'"}, 500)
    assert statuscmd.main(_args(), _cfg(server.port)) == 1
    captured = capsys.readouterr()
    assert "answered HTTP 500: status failed: KeyError 'wal'" in captured.err
    assert captured.out == ""


def test_a_retrying_batch_shows_its_state_attempt_and_error() -> None:
    batch = {
        "batch_id": 9,
        "rows": 10,
        "state": "retrying",
        "attempts": 3,
        "error": "Py4JError: connection refused",
        "duration_s": None,
    }
    text = statuscmd.render(sample_status(last_batch=batch))
    assert "#9  10 rows  retrying (attempt 3)  error: Py4JError: connection refused" in text


def test_a_starting_daemon_with_nothing_yet_renders_dashes() -> None:
    doc = {"healthy": False, "ready": False, "draining": False, "wal": None, "cores": []}
    text = statuscmd.render(doc)
    assert "NOT HEALTHY, not ready" in text
    assert "head -  floor -  segments -" in text
    assert "last batch  none yet" in text


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:9470/v1/status"),
        ("::", "http://[::1]:9470/v1/status"),
        ("::1", "http://[::1]:9470/v1/status"),
        ("10.0.0.5", "http://10.0.0.5:9470/v1/status"),
    ],
)
def test_admin_url_reaches_wildcard_listeners_through_loopback(host: str, url: str) -> None:
    assert statuscmd.admin_url(_cfg(9470, host)) == url


def test_summary_line_for_systemd_status() -> None:
    line = statuscmd.summary_line(sample_status())
    assert line == (
        "normal 1, catchup 1 · max lag 104,332 (core 1) · head 1204332 · batch 812 · dlq 3"
    )
    assert "\n" not in line
    assert statuscmd.summary_line({"draining": True, "cores": []}).startswith("draining")


def test_cli_routes_status_to_this_module(
    server: StatusServer, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from daemon.cli.main import main

    config = tmp_path / "config.toml"
    config.write_text(f'[admin]\nlisten = "127.0.0.1:{server.port}"\n')
    assert main(["status", "--config", str(config)]) == 0
    assert "healthy" in capsys.readouterr().out


def test_output_stream_is_injectable(server: StatusServer) -> None:
    out = io.StringIO()
    assert statuscmd.main(_args(), _cfg(server.port), out=out) == 0
    assert out.getvalue().startswith("eventplane  healthy")


def test_json_piped_into_a_reader_that_stops_early_exits_without_a_traceback(
    server: StatusServer, tmp_path: Any
) -> None:
    """``eventplane status --json | head -c 10``: the closed pipe is not an error trace."""
    import subprocess
    import sys

    server.serve(sample_status(padding=["x" * 100] * 2000))  # more than a pipe buffer
    config = tmp_path / "config.toml"
    config.write_text(f'[admin]\nlisten = "127.0.0.1:{server.port}"\n')
    status = f"{sys.executable} -m daemon.cli.main status --json --config {config}"
    command = f"{status} | head -c 10 >/dev/null"
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, check=False
    )
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 1


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("eventplane ")


def test_problems_and_stages_are_listed_for_an_unhealthy_daemon() -> None:
    doc = sample_status(
        healthy=False,
        problems=[{"part": "stage cdc:all", "message": "stage cdc:all has failed for 61 s"}],
        stages=[
            {"name": "cdc:all", "batch_id": 7, "behind_batches": 3, "failing": True,
             "stalled": True, "failing_for_s": 61.0, "attempts": 4, "last_error": "OSError: full"},
            {"name": "triggers", "batch_id": 10, "behind_batches": 0, "failing": False},
        ],
    )  # fmt: skip
    text = statuscmd.render(doc, now=NOW)
    assert "problem     stage cdc:all has failed for 61 s" in text
    assert "cdc:all       7       3  STALLED for 61 s, attempt 4: OSError: full" in text
    assert "triggers     10       0  ok" in text


def test_a_paused_stage_shows_since_when_by_whom_why_and_its_backlog() -> None:
    doc = sample_status(
        stages=[
            {"name": "cdc:all", "batch_id": 7, "behind_batches": 5, "behind_events": 12_345,
             "failing": False, "paused": True, "paused_since": NOW - 300,
             "paused_by": "ops@host", "paused_reason": "table maintenance"},
            {"name": "cdc:big", "batch_id": 2, "behind_batches": 10, "behind_events": 20_000_000,
             "failing": False, "paused": True, "paused_since": NOW - 7200,
             "paused_over_limit": True},
            {"name": "triggers", "batch_id": 9, "behind_batches": 3, "behind_events": 600,
             "failing": False, "paused": False},
        ],
    )  # fmt: skip
    text = statuscmd.render(doc, now=NOW)
    assert (
        "cdc:all       7       5  paused for 5 min 0 s by ops@host: table maintenance; "
        "12,345 events behind"
    ) in text
    assert "cdc:big       2      10  PAUSED, OVER ITS LIMIT for 2 h 0 min; 20,000,000" in text
    assert "triggers      9       3  catching up, 600 events behind" in text


def test_each_cdc_stream_shows_its_files_and_compactions() -> None:
    compaction = {
        "enabled": True,
        "files": 40,
        "max_files_per_partition": 22,
        "last": {"id": 12, "step": "done", "finished_at": NOW - 180},
        "running": {"id": 13, "partition": "collection=orders", "step": "writing"},
        "last_error": None,
        "scanned_at": NOW - 20,
    }
    spark = {"ready": True, "streams": {"all": {"path": "/t", "compaction": compaction}}}
    text = statuscmd.render(sample_status(spark=spark), now=NOW)
    assert (
        "cdc all     files 40 (max 22 per partition, counted 20 s ago)"
        "  last compaction #12 done 3 min 0 s ago  running #13 collection=orders writing"
    ) in text
    compaction["scanned_at"] = None  # a daemon that started since the last scan
    text = statuscmd.render(sample_status(spark=spark), now=NOW)
    assert "cdc all     files 40 (max 22 per partition, not counted yet)" in text


def test_spark_line_says_how_batches_reach_spark_once_known() -> None:
    """A session without the daemon's jar still works, only slower: status says
    so (and why) on the spark line; before the first batch nothing is said."""
    raw = statuscmd.render(sample_status(spark={"ready": True, "inbox": "raw"}), now=NOW)
    assert "spark       ready  inbox raw\n" in raw
    why = "parquet (eventplane.inbox.InboxSource is not on the driver JVM's class path)"
    fallback = statuscmd.render(sample_status(spark={"ready": True, "inbox": why}), now=NOW)
    assert f"spark       ready  inbox {why}\n" in fallback
    unknown = statuscmd.render(sample_status(spark={"ready": True, "inbox": None}), now=NOW)
    assert "spark       ready\n" in unknown
    direct = sample_status(spark={"ready": True, "inbox": "raw", "cdc_write": "direct"})
    assert "spark       ready  inbox raw  cdc write direct\n" in statuscmd.render(direct, now=NOW)


def test_a_file_count_older_than_the_last_batch_says_up_to_which_batch() -> None:
    """Right after the first commit the last scan counted an empty table:
    status says the count is from before that batch, not just "0 files"."""
    compaction = {
        "enabled": True, "files": 0, "max_files_per_partition": 0, "last": None,
        "running": None, "last_error": None, "scanned_at": NOW - 18, "scanned_batch_id": 0,
    }  # fmt: skip
    stream = {"path": "/t", "compaction": compaction, "last_batch_id": 1}
    spark = {"ready": True, "streams": {"all": stream}}
    text = statuscmd.render(sample_status(spark=spark), now=NOW)
    assert "files 0 (max 0 per partition, counted 18 s ago, before the first batch)" in text
    compaction["scanned_batch_id"], stream["last_batch_id"] = 4, 9
    text = statuscmd.render(sample_status(spark=spark), now=NOW)
    assert "counted 18 s ago, up to batch #4)" in text
    compaction["scanned_batch_id"] = 9
    assert "counted 18 s ago)" in statuscmd.render(sample_status(spark=spark), now=NOW)


def test_the_wal_archive_has_a_line_when_configured() -> None:
    from daemon.cli import status as statusmod

    archive = {"ack": "archived", "archived_lsn": 4, "unarchived_bytes": 100}
    archive |= {"unarchived_age_s": 0.2, "epoch": 2, "fenced": "fenced: taken", "outage": None}
    doc = {"wal": {"head_lsn": 5, "retained_floor": 1, "segments": 1, "archive": archive}}
    text = statusmod.render(doc)
    assert "archive     FENCED  ack archived  archived 4  unarchived 100 B / 0.2 s" in text
    assert "archive " not in statusmod.render({"wal": {"head_lsn": 5}})


def test_a_mirror_has_a_line_with_its_batch_and_cast_failures() -> None:
    doc = sample_status()
    doc["spark"] = {
        "ready": True,
        "mirrors": {"orders": {"last_batch_id": 41, "cast_failures": {"amount": 3, "day": 2}}},
    }
    text = statuscmd.render(doc, now=NOW)
    assert "mirror orders batch 41  5 values that did not fit their column\n" in text
    assert "in quarantine" not in text and "holding" not in text


def test_a_coalescing_mirror_line_names_the_batches_it_holds_for_its_next_merge() -> None:
    doc = sample_status()
    held = {"held_batches": 3, "held_batch_ids": [42, 44], "held_events": 1200}
    doc["spark"] = {"ready": True, "mirrors": {"orders": {"last_batch_id": 41, **held}}}
    text = statuscmd.render(doc, now=NOW)
    line = "mirror orders batch 41  0 values that did not fit their column  "
    assert line + "holding batches 42-44 (1,200 events) for one merge" in text


def test_a_mirror_with_events_in_its_quarantine_has_a_line_naming_the_command() -> None:
    doc = sample_status()
    doc["spark"] = {"mirrors": {"orders": {"last_batch_id": 41, "quarantined": 3}}}
    text = statuscmd.render(doc, now=NOW)
    assert (
        "mirror orders 3 events in quarantine (eventplane cdc mirror quarantine list orders)"
        in text
    )


def test_the_role_is_a_flag_and_a_standby_names_its_primary_or_none() -> None:
    standby = {
        "uri": "s3://lake/wal",
        "primary": "db-a",
        "holder": {"host": "db-a", "pid": 41},
        "epoch": 3,
        "error": None,
    }
    doc = sample_status(ready=False, role="standby", wal=None, standby=standby)
    text = statuscmd.render(doc, now=NOW)
    assert text.startswith("eventplane  healthy, not ready, standby")
    assert "standby     primary db-a pid 41, epoch 3  archive s3://lake/wal" in text
    alone = dict(standby, primary=None, error="cannot read s3://lake/wal/manifest.json: down")
    text = statuscmd.render(sample_status(role="standby", standby=alone), now=NOW)
    assert "standby     no primary holds the archive  archive s3://lake/wal" in text
    assert "            cannot read s3://lake/wal/manifest.json: down" in text
    primary = statuscmd.render(sample_status(role="primary"), now=NOW)
    assert primary.startswith("eventplane  healthy, ready, primary") and "standby " not in primary
