"""The producer clients and ``eventplane send`` against a real ingest server and WAL."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import send
from daemon.client import (
    Ack,
    BadRequestError,
    IngestClient,
    IngestConnectionError,
    InvalidEventsError,
    OverloadedError,
    PayloadTooLargeError,
    SyncIngestClient,
    parse_retry_after,
)
from daemon.config import ENV_CONFIG
from tests.conftest import free_port
from tests.ingest.conftest import StartIngest, event, make_cfg, ndjson, stored

ROOT = Path(__file__).resolve().parents[2]
EVENTPLANE = ROOT / ".venv" / "bin" / "eventplane"


class LagAfter:
    """lag() answers over the limit for the calls numbered in ``high`` (1-based)."""

    def __init__(self, *high: int) -> None:
        self.high = set(high)
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return 10**9 if self.calls in self.high else 0


# -- async client -------------------------------------------------------------------


async def test_async_client_sends_and_returns_the_ack(start_ingest: StartIngest, wal: Any) -> None:
    server = await start_ingest()
    async with IngestClient(server.url) as client:
        ack = await client.send([event(1), event(2)])
        again = await client.send_ndjson(ndjson([event(3)]))
    assert ack == Ack(2, 1, 2)
    assert again == Ack(1, 3, 3)
    assert [e.key for _, _, e in stored(wal)] == ["k1", "k2", "k3"]


async def test_async_client_raises_typed_errors_with_the_servers_message(
    start_ingest: StartIngest,
) -> None:
    server = await start_ingest(max_events_per_request=2)
    async with IngestClient(server.url) as client:
        with pytest.raises(InvalidEventsError) as invalid:
            await client.send([{"collection": "c", "op": "insert", "key": "k"}])
        with pytest.raises(BadRequestError) as bad:
            await client.send_ndjson(b"{nope\n")
        with pytest.raises(PayloadTooLargeError) as big:
            await client.send([event(i) for i in range(3)])
    assert invalid.value.status == 422
    assert invalid.value.errors == [
        {"index": 0, "line": 1, "field": "new", "reason": 'an insert needs the "new" object'}
    ]
    assert "nothing was stored" in invalid.value.message
    assert bad.value.status == 400 and bad.value.body["line"] == 1
    assert big.value.error == "too_many_events"
    assert "max_events_per_request" in str(big.value)


async def test_async_client_waits_retry_after_on_429_then_succeeds(
    start_ingest: StartIngest, wal: Any
) -> None:
    server = await start_ingest(max_lag_events=10, retry_after_s=7, lag=LagAfter(1, 2))
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    async with IngestClient(server.url, sleep=sleep) as client:
        ack = await client.send([event(1)])
    assert waits == [7.0, 7.0]
    assert ack == Ack(1, 1, 1)
    assert wal.head_lsn() == 1  # sent once, stored once


async def test_async_client_gives_up_after_max_retries(start_ingest: StartIngest) -> None:
    server = await start_ingest(max_lag_events=10, lag=lambda: 11)
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    async with IngestClient(server.url, max_retries=3, max_wait_s=0.5, sleep=sleep) as client:
        with pytest.raises(OverloadedError) as err:
            await client.send([event(1)])
    assert waits == [0.5, 0.5, 0.5]  # Retry-After 1 s, capped by max_wait_s
    assert err.value.retry_after == 1.0 and err.value.retriable


async def test_a_refused_connection_is_retried_until_the_budget_then_nothing_was_stored() -> None:
    """Refused connections are retried with a jittered exponential backoff (0.5 s
    doubling, each wait between half and all of it) until ``retry_for_s`` is spent."""
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    url = f"127.0.0.1:{free_port()}"
    async with IngestClient(url, retry_for_s=3.0, sleep=sleep) as client:
        with pytest.raises(IngestConnectionError) as err:
            await client.send([event(1)])
    assert err.value.maybe_sent is False and err.value.maybe_stored is False
    assert err.value.gave_up and err.value.attempts == len(waits) + 1
    assert 2 <= len(waits) <= 3 and sum(waits) <= 3.0
    for i, wait in enumerate(waits):
        assert 0.25 * 2**i <= wait <= 0.5 * 2**i
    assert "nothing of the request was stored" in str(err.value)


# -- sync client ----------------------------------------------------------------------


async def test_sync_client_keeps_one_connection_and_raises_typed_errors(
    start_ingest: StartIngest, wal: Any
) -> None:
    server = await start_ingest(max_lag_events=10, retry_after_s=2, lag=LagAfter(3))
    waits: list[float] = []

    def run() -> tuple[Ack, Ack, InvalidEventsError]:
        with SyncIngestClient(server.url, sleep=waits.append) as client:
            first = client.send([event(1)])
            invalid = None
            try:
                client.send([{"collection": "c", "op": "delete", "key": "k", "new": {}}])
            except InvalidEventsError as exc:
                invalid = exc
            second = client.send([event(2)])  # 429 once (third lag() call), then stored
            assert invalid is not None
            return first, second, invalid

    first, second, invalid = await asyncio.to_thread(run)
    assert first == Ack(1, 1, 1)
    assert second == Ack(1, 2, 2)
    assert waits == [2.0]
    assert invalid.errors[0]["field"] == "new"
    assert [e.key for _, _, e in stored(wal)] == ["k1", "k2"]


def test_retry_after_accepts_seconds_and_http_dates() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


# -- eventplane send ---------------------------------------------------------------------


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text('[daemon]\ndata_dir = "data"\n')
    return path


async def run_send(tmp_path: Path, url: str, stdin: bytes, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(EVENTPLANE),
        "send",
        "--config",
        str(write_config(tmp_path)),
        "--url",
        url,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60.0)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_send_with_url_needs_no_config_file(
    start_ingest: StartIngest, wal: Any, tmp_path: Path
) -> None:
    server = await start_ingest()
    proc = await asyncio.create_subprocess_exec(
        str(EVENTPLANE),
        "send",
        "--url",
        server.url,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,  # no config.toml here
        env={k: v for k, v in os.environ.items() if k != ENV_CONFIG},
    )
    out, err = await asyncio.wait_for(proc.communicate(ndjson([event(1), event(2)])), 60.0)
    assert proc.returncode == 0, err.decode()
    assert out.decode().startswith("sent 2 events in 1 requests, LSN 1..2, ")
    assert [e.key for _, _, e in stored(wal)] == ["k1", "k2"]


async def test_send_posts_stdin_in_batches_in_order(
    start_ingest: StartIngest, wal: Any, tmp_path: Path
) -> None:
    server = await start_ingest()
    lines = ndjson([event(i) for i in range(10)]).splitlines(keepends=True)
    stdin = b"".join(lines[:4]) + b"\n   \n" + b"".join(lines[4:])
    code, out, err = await run_send(tmp_path, server.url, stdin, "--batch", "3")
    assert code == 0, err
    assert out.startswith("sent 10 events in 4 requests, LSN 1..10, ")
    assert err == ""  # stderr is not a terminal: no progress lines
    assert [e.key for _, _, e in stored(wal)] == [f"k{i}" for i in range(10)]


async def test_send_stops_at_a_refused_batch_with_stdin_line_numbers(
    start_ingest: StartIngest, wal: Any, tmp_path: Path
) -> None:
    """1. Batches of 3; stdin line 5 is invalid, so the second batch is refused.
    2. send exits 1 naming stdin line 5, the server's reason, and what was acked.
    3. The WAL holds the first batch only, once."""
    server = await start_ingest()
    events: list[Any] = [event(i) for i in range(9)]
    events[4] = {"collection": "orders", "op": "update", "key": "k4"}
    code, out, err = await run_send(tmp_path, server.url, ndjson(events), "--batch", "3")
    assert code == 1
    assert out == ""
    assert "request 2 (stdin lines 4-6) refused, HTTP 422 invalid_events" in err
    assert 'stdin line 5 new: an update needs the "new" object' in err
    assert "acknowledged before it: 3 events (LSN 1..3); to send the rest: tail -n +4" in err
    assert [e.key for _, _, e in stored(wal)] == ["k0", "k1", "k2"]


async def test_send_retries_429_and_never_resends_an_acked_batch(
    start_ingest: StartIngest, wal: Any, tmp_path: Path
) -> None:
    server = await start_ingest(max_lag_events=10, retry_after_s=1, lag=LagAfter(2))
    code, out, err = await run_send(
        tmp_path, server.url, ndjson([event(i) for i in range(6)]), "--batch", "2"
    )
    assert code == 0, err
    assert "sent 6 events in 3 requests (1 retried), LSN 1..6" in out
    assert "request 2 (stdin lines 3-4): attempt 2 in 1.0 s " in err
    assert "after HTTP 429 over_lag_limit: the slowest consumer is " in err
    assert [e.key for _, _, e in stored(wal)] == [f"k{i}" for i in range(6)]


async def test_send_reports_an_unreachable_daemon_once_its_retry_budget_is_spent(
    tmp_path: Path,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = await run_send(tmp_path, url, ndjson([event(1)]), "--retry-for", "1")
    assert code == 1
    assert "request 1 (stdin lines 1-1): gave up after " in err
    assert "cannot connect to" in err
    assert "acknowledged before it: 0 events; stdin lines 1-1 were not stored" in err
    assert "to send the rest: tail -n +1" in err


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_send_draws_progress_on_a_terminal(
    start_ingest: StartIngest, wal: Any, tmp_path: Path
) -> None:
    server = await start_ingest()
    args = argparse.Namespace(url=server.url, batch=5)
    stdin = io.BytesIO(ndjson([event(i) for i in range(20)]))
    out, err = io.StringIO(), FakeTty()
    code = await asyncio.to_thread(send.main, args, make_cfg(tmp_path), stdin, out, err)
    assert code == 0
    assert "\rsent 5 events in 1 requests" in err.getvalue()
    assert out.getvalue().startswith("sent 20 events in 4 requests")
    assert wal.head_lsn() == 20


def test_send_rejects_a_zero_batch(tmp_path: Path) -> None:
    err = io.StringIO()
    args = argparse.Namespace(url="http://127.0.0.1:1", batch=0)
    assert send.main(args, make_cfg(tmp_path), io.BytesIO(b""), io.StringIO(), err) == 2
    assert "--batch must be >= 1" in err.getvalue()


def test_eventplane_console_script_is_installed() -> None:
    assert EVENTPLANE.exists(), f"{EVENTPLANE} missing: run `make test` to install"
    assert sys.executable
