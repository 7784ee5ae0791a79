"""Producer failover over real HTTP on loopback (docs/ingest.md, "Clients and retries").

Real ingest servers, each on its own WAL: a primary, a standby (its
``standby`` gate set, as the daemon does with ``[wal.archive] role =
"standby"``), and a port where nothing listens (a daemon that is down). A
request given all of them lands once, on the primary, under one key.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon import client as clientmod
from daemon.client import (
    Ack,
    Client,
    IngestClient,
    IngestConnectionError,
    NotPrimaryError,
    PayloadTooLargeError,
    Retry,
    StandbyError,
    SyncIngestClient,
)
from daemon.config import Listen
from daemon.ingest.server import IngestServer
from tests.conftest import free_port
from tests.ingest.conftest import StartIngest, event, ndjson, open_wal
from tests.ingest.test_client_send import run_send
from wal import Wal

BODY = ndjson([event(i) for i in range(5)])
PRIMARY_HOST = "db-a.example"


@pytest.fixture
async def standby_wal(tmp_path: Path) -> AsyncIterator[Wal]:
    w = await asyncio.to_thread(open_wal, tmp_path / "standby-wal")
    yield w
    await w.aclose()


@pytest.fixture
def start_standby(start_ingest: StartIngest, standby_wal: Wal) -> Callable[..., Awaitable[Any]]:
    async def start(**kw: Any) -> IngestServer:
        server = await start_ingest(wal_=standby_wal, **kw)
        server.standby = lambda: PRIMARY_HOST
        return server

    return start


def down_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


Send = Callable[..., Awaitable[tuple[Ack, list[Retry]]]]


@pytest.fixture(params=["async", "sync"])
def send_to(request: pytest.FixtureRequest) -> Send:
    """``send(endpoints, body, on_sleep=..., **kw)`` through either client: the ack and
    every ``on_retry`` call. ``on_sleep`` runs on the loop instead of each wait."""
    flavour = request.param

    async def send(
        endpoints: list[str],
        body: bytes,
        *,
        on_sleep: Callable[[float], Awaitable[None]] | None = None,
        **kw: Any,
    ) -> tuple[Ack, list[Retry]]:
        loop = asyncio.get_running_loop()
        retries: list[Retry] = []

        async def nap(s: float) -> None:
            if on_sleep is not None:
                await on_sleep(s)

        if flavour == "async":
            async with Client(endpoints=endpoints, sleep=nap, on_retry=retries.append, **kw) as c:
                return await c.send_ndjson(body), retries

        def sync_nap(s: float) -> None:
            asyncio.run_coroutine_threadsafe(nap(s), loop).result()

        def run() -> Ack:
            with SyncIngestClient(
                endpoints=endpoints, sleep=sync_nap, on_retry=retries.append, **kw
            ) as c:
                return c.send_ndjson(body)

        return await asyncio.to_thread(run), retries

    return send


async def test_a_request_fails_over_past_a_down_daemon_and_a_standby_and_lands_once(
    start_ingest: StartIngest,
    start_standby: Callable[..., Awaitable[IngestServer]],
    wal: Wal,
    standby_wal: Wal,
    send_to: Send,
) -> None:
    """1. The first endpoint is down: the connection is refused, nothing was sent.
    2. The second is a standby: 503 standby naming the primary's host.
    3. The third, the primary, stores the request: once, under the one key every
       attempt carried, without a wait in between."""
    standby = await start_standby()
    primary = await start_ingest()
    waits: list[float] = []

    async def record(s: float) -> None:
        waits.append(s)

    ack, retries = await send_to([down_url(), standby.url, primary.url], BODY, on_sleep=record)
    assert ack == Ack(5, 1, 5, replayed=False)
    assert waits == [], "a failover does not wait"
    assert [type(r.error) for r in retries] == [IngestConnectionError, StandbyError]
    assert [r.wait_s for r in retries] == [0.0, 0.0]
    assert [r.endpoint for r in retries] == [standby.url + "/v1/events", primary.url + "/v1/events"]
    standby_error = retries[1].error
    assert isinstance(standby_error, StandbyError) and standby_error.primary == PRIMARY_HOST
    assert standby_error.status == 503 and standby_error.retry_after == 1.0
    keys = {r.key for r in retries}
    assert len(keys) == 1
    assert wal.head_lsn() == 5 and wal.request_keys() == 1
    assert wal.find_request(keys.pop().encode()) is not None
    assert standby_wal.head_lsn() == 0 and standby_wal.request_keys() == 0


async def test_after_a_failover_the_next_requests_go_to_the_endpoint_that_answered(
    start_ingest: StartIngest,
    start_standby: Callable[..., Awaitable[IngestServer]],
    wal: Wal,
) -> None:
    standby = await start_standby()
    primary = await start_ingest()
    retries: list[Retry] = []
    async with IngestClient(endpoints=[standby.url, primary.url], on_retry=retries.append) as c:
        first = await c.send([event(1)])
        assert c.url == primary.url + "/v1/events"
        second = await c.send([event(2)])
    assert (first.first_lsn, second.first_lsn) == (1, 2)
    assert len(retries) == 1, "only the first request met the standby"


async def test_a_round_of_failures_waits_then_starts_again_at_the_first_endpoint(
    start_ingest: StartIngest,
    start_standby: Callable[..., Awaitable[IngestServer]],
    wal: Wal,
    send_to: Send,
) -> None:
    """1. The primary is down, the standby answers standby (Retry-After 1 s): every
       endpoint failed once, so the client waits the standby's Retry-After.
    2. During the wait the primary comes up on its address (a restart).
    3. The next round starts at the first endpoint: stored once, one key."""
    port = free_port()
    standby = await start_standby()
    started: list[IngestServer] = []
    waits: list[float] = []

    async def bring_up(s: float) -> None:
        waits.append(s)
        if not started:
            started.append(await start_ingest(listen=Listen("127.0.0.1", port)))

    ack, retries = await send_to([f"http://127.0.0.1:{port}", standby.url], BODY, on_sleep=bring_up)
    assert ack == Ack(5, 1, 5)
    assert waits == [1.0]
    assert [type(r.error) for r in retries] == [IngestConnectionError, StandbyError]
    assert retries[1].endpoint == f"http://127.0.0.1:{port}/v1/events"
    assert len({r.key for r in retries}) == 1
    assert wal.head_lsn() == 5 and wal.request_keys() == 1


async def test_an_unanswered_attempt_retried_after_a_failover_is_a_replay_not_a_copy(
    start_ingest: StartIngest,
    start_standby: Callable[..., Awaitable[IngestServer]],
    wal: Wal,
    send_to: Send,
) -> None:
    """1. The primary's WAL append is slow: the attempt times out unanswered (it may
       be stored, and is).
    2. The client fails over to the standby: 503 standby; the round is over, so it
       waits the standby's Retry-After.
    3. Back at the primary with the same key: the first attempt's LSNs, replayed;
       the WAL holds the events once."""
    standby = await start_standby()
    primary = await start_ingest()
    real_append = wal.append

    async def slow_append(*args: Any) -> tuple[int, int]:
        await asyncio.sleep(0.6)
        result: tuple[int, int] = await real_append(*args)
        return result

    async def nap(s: float) -> None:
        await asyncio.sleep(s)

    with mock.patch.object(wal, "append", side_effect=slow_append):
        ack, retries = await send_to([primary.url, standby.url], BODY, timeout_s=0.3, on_sleep=nap)
    assert ack == Ack(5, 1, 5, replayed=True)
    assert [type(r.error) for r in retries] == [IngestConnectionError, StandbyError]
    assert isinstance(retries[0].error, IngestConnectionError) and retries[0].error.maybe_sent
    assert len({r.key for r in retries}) == 1
    assert wal.head_lsn() == 5 and wal.request_keys() == 1


async def test_a_refusal_at_another_endpoint_leaves_an_unanswered_attempt_maybe_stored(
    start_ingest: StartIngest, wal: Wal, standby_wal: Wal, send_to: Send
) -> None:
    """1. The first daemon's WAL append is slow: the attempt times out unanswered,
       and that daemon does store the request.
    2. The failover goes to a daemon with a lower event limit: 413, not retried.
    3. The error says the request may be stored: that refusal settles nothing at
       the first daemon."""
    first = await start_ingest()
    strict = await start_ingest(wal_=standby_wal, max_events_per_request=2)
    real_append = wal.append

    async def slow_append(*args: Any) -> tuple[int, int]:
        await asyncio.sleep(0.6)
        result: tuple[int, int] = await real_append(*args)
        return result

    with mock.patch.object(wal, "append", side_effect=slow_append):
        with pytest.raises(PayloadTooLargeError) as err:
            await send_to([first.url, strict.url], BODY, timeout_s=0.3)
        await asyncio.sleep(0.6)
    assert err.value.maybe_stored and not err.value.gave_up
    assert wal.head_lsn() == 5 and standby_wal.head_lsn() == 0


async def test_out_of_retries_at_every_endpoint_names_them_and_the_key(
    start_standby: Callable[..., Awaitable[IngestServer]], send_to: Send
) -> None:
    standby = await start_standby()

    async def nap(s: float) -> None:
        pass

    with pytest.raises(StandbyError) as err:
        await send_to([down_url(), standby.url], BODY, on_sleep=nap, retry_for_s=1.5)
    exc = err.value
    # Two rounds of two attempts: a wait of 1 s after each round; the third is over 1.5 s.
    assert exc.gave_up and exc.attempts == 4 and not exc.maybe_stored
    assert "gave up after 4 attempts in " in str(exc) and " at 2 endpoints" in str(exc)
    assert exc.key is not None


def test_endpoints_replace_url_and_are_a_list() -> None:
    assert clientmod.Client is IngestClient
    with SyncIngestClient("http://127.0.0.1:1") as one:
        assert one.endpoints == ("http://127.0.0.1:1/v1/events",)
    with SyncIngestClient(endpoints=["127.0.0.1:1", "http://127.0.0.1:2/"]) as two:
        assert two.endpoints == ("http://127.0.0.1:1/v1/events", "http://127.0.0.1:2/v1/events")
        assert two.url == two.endpoints[0]
    with pytest.raises(ValueError, match="url or endpoints, not both"):
        SyncIngestClient("http://a:1", endpoints=["http://b:1"])
    with pytest.raises(ValueError, match="at least one URL"):
        SyncIngestClient(endpoints=[])
    with pytest.raises(TypeError, match="a list of URLs"):
        SyncIngestClient(endpoints="http://a:1")


# -- eventplane send ---------------------------------------------------------------------


async def test_send_with_two_urls_fails_over_from_a_standby_and_stores_each_batch_once(
    start_ingest: StartIngest,
    start_standby: Callable[..., Awaitable[IngestServer]],
    wal: Wal,
    standby_wal: Wal,
    tmp_path: Path,
) -> None:
    """``send --url STANDBY --url PRIMARY``: the first batch meets the standby and
    fails over; the rest go to the primary directly. Every event is stored once,
    each batch under its own key."""
    standby = await start_standby()
    primary = await start_ingest()
    stdin = ndjson([event(i) for i in range(6)])
    code, out, err = await run_send(
        tmp_path, standby.url, stdin, "--url", primary.url, "--batch", "2", "--key-prefix", "fo"
    )
    assert code == 0, err
    assert out.startswith("sent 6 events in 3 requests (1 retried), LSN 1..6, ")
    assert f"request 1 (stdin lines 1-2): attempt 2 at {primary.url}/v1/events in 0.0 s" in err
    assert "after HTTP 503 standby: this daemon is a standby" in err
    assert wal.head_lsn() == 6 and wal.request_keys() == 3
    assert all(wal.find_request(f"fo:{line}".encode()) for line in (1, 3, 5))
    assert standby_wal.head_lsn() == 0


async def test_send_out_of_retries_with_two_urls_prints_a_resend_with_both(
    start_standby: Callable[..., Awaitable[IngestServer]], tmp_path: Path
) -> None:
    standby = await start_standby()
    down = down_url()
    code, _, err = await run_send(
        tmp_path, down, ndjson([event(1)]), "--url", standby.url, "--retry-for", "0.5"
    )
    assert code == 1
    assert "request 1 (stdin lines 1-1): gave up after 2 attempts in " in err
    assert "the last: HTTP 503 standby: this daemon is a standby" in err
    assert "stdin lines 1-1 were not stored; to send the rest: tail -n +1" in err


def test_the_resend_command_repeats_every_url() -> None:
    import argparse

    from daemon.cli.send import resend_command

    args = argparse.Namespace(url=["http://a:1", "http://b:2"], config=None)
    assert resend_command(args, "p", 1000, 7) == (
        "eventplane send --url http://a:1 --url http://b:2 --key-prefix p --from-line 7"
    )


class _LapsedLease:
    """The archive gate of a primary whose manifest lapsed (daemon/walarchive.py)."""

    acks_archived = False

    def lease_refusal(self) -> str:
        return "this daemon has not renewed the archive's manifest for over 25 s"

    def refusal(self) -> str:
        return self.lease_refusal()

    async def until_archived(self, lsn: int) -> None:
        return None


async def test_a_primary_whose_manifest_lapsed_answers_not_primary_and_the_request_fails_over(
    start_ingest: StartIngest,
    standby_wal: Wal,
    wal: Wal,
    send_to: Send,
) -> None:
    """An old primary (its manifest not renewed in time) answers 503
    ``not_primary`` and stores nothing; the request goes on at once to the next
    endpoint (the standby that took over) and lands there once."""
    old = await start_ingest(wal_=standby_wal)
    old.archive = _LapsedLease()  # type: ignore[assignment]
    new = await start_ingest()
    ack, retries = await send_to([old.url, new.url], BODY)
    assert (ack.first_lsn, ack.last_lsn) == (1, 5)
    assert len(retries) == 1 and retries[0].wait_s == 0.0
    error = retries[0].error
    assert isinstance(error, NotPrimaryError) and error.status == 503, error
    assert "has not renewed the archive's manifest" in str(error)
    assert standby_wal.head_lsn() == 0 and wal.head_lsn() == 5
