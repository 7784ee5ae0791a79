"""The producer clients' retries, over real HTTP on loopback.

A small scripted server stands in for the daemon where a failure has to happen
on purpose (a connection dropped after the request was stored, a 503 with
Retry-After, an answer that comes too late); it keeps the daemon's
Idempotency-Key contract (docs/ingest.md, "Idempotent requests"): a known key
with the same body is answered from the first request, marked as a replay.
The last tests run against the real ingest server and WAL.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest
from aiohttp import web

from daemon.cli import send
from daemon.client import (
    Ack,
    IngestClient,
    IngestConnectionError,
    InvalidEventsError,
    Retry,
    SyncIngestClient,
    UnavailableError,
)
from tests.conftest import free_port
from tests.ingest.conftest import StartIngest, event, make_cfg, ndjson
from tests.ingest.test_client_send import FakeTty, run_send

Step = str | tuple[Any, ...]


class ScriptedDaemon:
    """Answers each request with the next step of its script, then "ok".

    Steps: ``"ok"`` store and answer 200; ``"lost"`` store, then drop the
    connection without an answer; ``"reset"`` drop it without storing;
    ``("slow", s)`` store, answer after ``s`` seconds; ``("status", code, error,
    retry_after)`` answer that refusal. A request whose key was stored with the
    same body is answered from it (200, ``"replayed": true``) whatever the script,
    unless ``window`` is off (a daemon whose de-duplication window forgot the key).
    """

    def __init__(self, *script: Step, port: int | None = None, window: bool = True) -> None:
        self.script = list(script)
        self.window = window
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[tuple[str | None, bytes]] = []
        self.stored: dict[str, tuple[bytes, bytes]] = {}  # key -> (body, ack JSON)
        self.next_lsn = 1
        self._runner: web.AppRunner | None = None

    async def start(self) -> ScriptedDaemon:
        if self._runner is None:
            app = web.Application()
            app.router.add_post("/v1/events", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def keys(self) -> list[str | None]:
        return [key for key, _ in self.seen]

    def _store(self, key: str | None, body: bytes) -> bytes:
        n = body.count(b"\n")
        ack = msgspec.json.encode(
            {"accepted": n, "first_lsn": self.next_lsn, "last_lsn": self.next_lsn + n - 1}
        )
        self.next_lsn += n
        if key is not None:
            self.stored[key] = (body, ack)
        return ack

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = request.headers.get("Idempotency-Key")
        self.seen.append((key, body))
        if self.window and key in self.stored and self.stored[key][0] == body:
            replay = self.stored[key][1][:-1] + b',"replayed":true}'
            return web.Response(
                body=replay,
                content_type="application/json",
                headers={"Idempotent-Replayed": "true"},
            )
        step = self.script.pop(0) if self.script else "ok"
        if step in ("lost", "reset"):
            if step == "lost":
                self._store(key, body)
            assert request.transport is not None
            request.transport.abort()
            return web.Response()  # never sent: the connection is gone
        if isinstance(step, tuple) and step[0] == "status":
            _, code, error, retry_after = step
            headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
            doc = {"error": error, "message": f"{error} on purpose; nothing was stored"}
            return web.json_response(doc, status=code, headers=headers)
        ack = self._store(key, body)
        if isinstance(step, tuple) and step[0] == "slow":
            await asyncio.sleep(step[1])
        return web.Response(body=ack, content_type="application/json")


@pytest.fixture
async def daemons() -> AsyncIterator[Callable[..., ScriptedDaemon]]:
    made: list[ScriptedDaemon] = []

    def make(*script: Step, port: int | None = None, window: bool = True) -> ScriptedDaemon:
        made.append(ScriptedDaemon(*script, port=port, window=window))
        return made[-1]

    yield make
    for d in made:
        await d.stop()


Send = Callable[..., Awaitable[Ack]]


@pytest.fixture(params=["async", "sync"])
def send_with(request: pytest.FixtureRequest) -> Send:
    """``send(url, body, on_sleep=..., **client_kw)`` through either client. ``on_sleep``
    is called on the event loop with each wait instead of sleeping."""
    flavour = request.param

    async def send(
        url: str,
        body: bytes,
        *,
        on_sleep: Callable[[float], Awaitable[None]] | None = None,
        key: str | None = None,
        **kw: Any,
    ) -> Ack:
        loop = asyncio.get_running_loop()

        async def nap(s: float) -> None:
            if on_sleep is not None:
                await on_sleep(s)

        if flavour == "async":
            async with IngestClient(url, sleep=nap, **kw) as client:
                return await client.send_ndjson(body, key=key)

        def sync_nap(s: float) -> None:
            asyncio.run_coroutine_threadsafe(nap(s), loop).result()

        def run() -> Ack:
            with SyncIngestClient(url, sleep=sync_nap, **kw) as client:
                return client.send_ndjson(body, key=key)

        return await asyncio.to_thread(run)

    return send


BODY = ndjson([event(i) for i in range(5)])
KEY = re.compile(r"ep-[0-9a-f]{16}-1")


async def test_a_refused_connection_is_retried_once_the_daemon_listens(
    daemons: Callable[..., ScriptedDaemon], send_with: Send
) -> None:
    """1. Nothing listens: the first attempt is refused (nothing was sent).
    2. During the backoff the daemon starts; the retry is stored once."""
    daemon = daemons()
    waits: list[float] = []

    async def start_then(s: float) -> None:
        waits.append(s)
        await daemon.start()

    ack = await send_with(daemon.url, BODY, on_sleep=start_then)
    assert ack == Ack(5, 1, 5, replayed=False)
    assert len(waits) == 1 and 0.25 <= waits[0] <= 0.5
    assert len(daemon.seen) == 1 and KEY.fullmatch(daemon.keys[0] or "")


async def test_every_retry_of_one_request_carries_the_same_key_and_body(
    daemons: Callable[..., ScriptedDaemon], send_with: Send
) -> None:
    """A reset, a 503 with Retry-After, a 507 and a 429: four retries, one key, one body,
    and the request is stored once."""
    daemon = await daemons(
        "reset",
        ("status", 503, "draining", 2),
        ("status", 507, "wal_full", 1),
        ("status", 429, "over_lag_limit", 3),
    ).start()
    waits: list[float] = []

    async def record(s: float) -> None:
        waits.append(s)

    ack = await send_with(daemon.url, BODY, on_sleep=record)
    assert ack == Ack(5, 1, 5)
    assert len(daemon.seen) == 5
    assert len(set(daemon.keys)) == 1 and KEY.fullmatch(daemon.keys[0] or "")
    assert {body for _, body in daemon.seen} == {BODY}
    assert 0.25 <= waits[0] <= 0.5  # after the reset: backoff with jitter
    assert waits[1:] == [2.0, 1.0, 3.0]  # Retry-After, as the daemon said


async def test_a_request_stored_before_its_answer_was_lost_is_answered_as_a_replay(
    daemons: Callable[..., ScriptedDaemon], send_with: Send
) -> None:
    """1. The daemon stores the request, then the connection drops (no answer).
    2. The retry, same key and body, gets the first request's LSNs marked replayed:
       a success, and the request is stored once."""
    daemon = await daemons("lost").start()
    ack = await send_with(daemon.url, BODY, on_sleep=None)
    assert ack == Ack(5, 1, 5, replayed=True)
    assert daemon.next_lsn == 6, "stored once"
    assert len(daemon.seen) == 2 and daemon.keys[0] == daemon.keys[1]


async def test_an_attempt_over_the_timeout_is_retried_with_the_same_key(
    daemons: Callable[..., ScriptedDaemon], send_with: Send
) -> None:
    daemon = await daemons(("slow", 1.5)).start()
    ack = await send_with(daemon.url, BODY, timeout_s=0.3)
    assert ack.replayed and (ack.first_lsn, ack.last_lsn) == (1, 5)
    assert daemon.next_lsn == 6
    assert len(daemon.seen) == 2 and daemon.keys[0] == daemon.keys[1]


async def test_a_422_is_not_retried(
    daemons: Callable[..., ScriptedDaemon], send_with: Send
) -> None:
    daemon = await daemons(("status", 422, "invalid_events", None)).start()
    waits: list[float] = []

    async def record(s: float) -> None:
        waits.append(s)

    with pytest.raises(InvalidEventsError) as err:
        await send_with(daemon.url, BODY, on_sleep=record)
    assert waits == [] and len(daemon.seen) == 1
    assert err.value.attempts == 1 and not err.value.gave_up and not err.value.maybe_stored


async def test_a_spent_budget_after_an_unanswered_attempt_says_the_request_may_be_stored(
    daemons: Callable[..., ScriptedDaemon], send_with: Send
) -> None:
    """1. The first attempt is stored but its answer is lost; the daemon then drains
       (it answers 503 before it looks at keys).
    2. retry_for_s runs out on 503s: the 503 is raised, marked gave_up and
       maybe_stored, naming the key to resend with."""
    daemon = await daemons("lost", *[("status", 503, "draining", 1)] * 10, window=False).start()

    async def nap(s: float) -> None:
        pass

    with pytest.raises(UnavailableError) as err:
        await send_with(daemon.url, BODY, on_sleep=nap, retry_for_s=2.0)
    exc = err.value
    assert exc.gave_up and exc.maybe_stored
    # The lost one, a backoff of 0.25-0.5 s, a 503, 1 s, a 503; 1 s more is over 2 s.
    assert exc.attempts == 3
    assert exc.key is not None and KEY.fullmatch(exc.key)
    assert f"resending it with Idempotency-Key {exc.key!r} is safe" in str(exc)
    assert exc.message.startswith("draining on purpose")


async def test_each_request_gets_its_own_key_and_a_callers_key_is_used(
    daemons: Callable[..., ScriptedDaemon],
) -> None:
    daemon = await daemons().start()
    retries: list[Retry] = []
    async with IngestClient(daemon.url, key_prefix="orders-svc-3", on_retry=retries.append) as c:
        await c.send([event(1)])
        await c.send([event(2)])
        await c.send([event(3)], key="orders-svc-3:resend-7")
    assert daemon.keys == ["orders-svc-3-1", "orders-svc-3-2", "orders-svc-3:resend-7"]
    assert retries == []
    with pytest.raises(ValueError, match="visible ASCII"):
        IngestClient(daemon.url, key_prefix="has space")


# -- eventplane send ---------------------------------------------------------------------


async def test_send_counts_retried_and_replayed_requests_in_its_summary(
    daemons: Callable[..., ScriptedDaemon], tmp_path: Path
) -> None:
    """Three batches of 2: the second is stored but its answer lost, so its retry is a
    replay; the third gets one 503 first. Keys are PREFIX:<first stdin line>."""
    daemon = await daemons("ok", "lost", ("status", 503, "draining", 1)).start()
    code, out, err = await run_send(
        tmp_path,
        daemon.url,
        ndjson([event(i) for i in range(6)]),
        "--batch",
        "2",
        "--key-prefix",
        "nightly-load",
    )
    assert code == 0, err
    assert out.startswith("sent 6 events in 3 requests (2 retried, 1 replayed), LSN 1..6, ")
    assert daemon.keys == [
        "nightly-load:1",
        "nightly-load:3",
        "nightly-load:3",
        "nightly-load:5",
        "nightly-load:5",
    ]
    assert daemon.next_lsn == 7, "every event stored once"
    assert "request 3 (stdin lines 5-6): attempt 2 in 1.0 s (" in err
    assert "after HTTP 503 draining: draining on purpose" in err


async def test_send_out_of_retries_after_an_unanswered_attempt_prints_the_safe_resend(
    daemons: Callable[..., ScriptedDaemon], tmp_path: Path
) -> None:
    """1. Batch 2 is stored, its answer lost; the daemon then answers 503 (Retry-After
       1 s) until --retry-for runs out: 0.25-0.5 s of backoff and 1 s are over 1.2 s.
    2. send exits 1: lines 3-4 may or may not be stored, nothing after them was
       sent, and the command to resend with the same keys is printed."""
    daemon = await daemons(
        "ok", "lost", *[("status", 503, "draining", 1)] * 20, window=False
    ).start()
    code, out, err = await run_send(
        tmp_path,
        daemon.url,
        ndjson([event(i) for i in range(6)]),
        "--batch",
        "2",
        "--key-prefix",
        "p1",
        "--retry-for",
        "1.2",
    )
    assert code == 1 and out == ""
    assert "request 2 (stdin lines 3-4): gave up after 2 attempts in " in err
    assert "the last: HTTP 503 draining: draining on purpose" in err
    assert (
        "acknowledged before it: 2 events (LSN 1..2); stdin lines 3-4 may or may not have "
        "been stored; nothing after them was sent" in err
    )
    assert "nothing is stored twice within the daemon's de-duplication window" in err
    assert f"eventplane send --config {tmp_path / 'config.toml'} --url {daemon.url} " in err
    assert "--batch 2 --key-prefix p1 --from-line 3" in err


async def test_send_on_a_terminal_shows_the_request_being_retried(
    daemons: Callable[..., ScriptedDaemon], tmp_path: Path
) -> None:
    daemon = await daemons(("status", 503, "draining", 1)).start()
    args = argparse.Namespace(url=daemon.url, batch=2)
    stdin = io.BytesIO(ndjson([event(i) for i in range(4)]))
    out, err = io.StringIO(), FakeTty()
    code = await asyncio.to_thread(send.main, args, make_cfg(tmp_path), stdin, out, err)
    assert code == 0
    assert (
        "\rrequest 1 (stdin lines 1-2): attempt 2 in 1.0 s (0 s of --retry-for 120) "
        "after HTTP 503 draining: draining on purpose; nothing was stored\x1b[K"
    ) in err.getvalue()
    assert out.getvalue().startswith("sent 4 events in 2 requests (1 retried), LSN 1..4, ")


# -- against the real ingest server ------------------------------------------------------


async def test_a_retry_after_a_timeout_waits_for_the_first_attempt_and_is_a_replay(
    start_ingest: StartIngest, wal: Any
) -> None:
    """The daemon's side of the contract (daemon.ingest.server):
    1. The first attempt's WAL append is slow: the client times out and retries.
    2. The retry, same key, waits for the first attempt and gets its LSNs, replayed.
    3. The WAL holds the events once."""
    server = await start_ingest()
    real_append = wal.append
    calls = 0

    async def slow_append(*args: Any) -> tuple[int, int]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(1.0)
        result: tuple[int, int] = await real_append(*args)
        return result

    with mock.patch.object(wal, "append", side_effect=slow_append):
        async with IngestClient(server.url, timeout_s=0.3) as client:
            ack = await client.send([event(i) for i in range(3)])
    assert ack == Ack(3, 1, 3, replayed=True)
    assert calls == 1 and wal.head_lsn() == 3


async def test_send_resent_from_a_line_with_the_same_prefix_stores_nothing_twice(
    start_ingest: StartIngest, wal: Any, tmp_path: Path
) -> None:
    """The resend command send prints: the same input, --key-prefix and --from-line
    give the same keys and bodies, so requests already stored are replays."""
    server = await start_ingest()
    stdin = ndjson([event(i) for i in range(6)])
    args = ("--batch", "2", "--key-prefix", "load-42")
    code, out, err = await run_send(tmp_path, server.url, stdin, *args)
    assert code == 0, err and out.startswith("sent 6 events in 3 requests, LSN 1..6")
    code, out, err = await run_send(tmp_path, server.url, stdin, *args, "--from-line", "3")
    assert code == 0, err
    assert out.startswith("sent 4 events in 2 requests (2 replayed), LSN 3..6, ")
    assert wal.head_lsn() == 6


async def test_the_scripted_daemon_drops_a_connection_without_an_answer(
    daemons: Callable[..., ScriptedDaemon],
) -> None:
    """The stand-in really drops: with no retry budget the client reports it."""
    daemon = await daemons("reset").start()
    async with IngestClient(daemon.url, retry_for_s=0) as client:
        with pytest.raises(IngestConnectionError) as err:
            await client.send_ndjson(BODY)
    assert err.value.maybe_sent and err.value.maybe_stored and err.value.gave_up
