"""Per-producer quotas: a token bucket of one second's worth per limit; over it, 429
with Retry-After, counted per producer, nothing stored, other producers unharmed."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from typing import Any

import aiohttp

from daemon.config import ProducerToken
from daemon.ingest.quota import Quotas
from daemon.service.metrics import Metrics
from tests.ingest.conftest import NDJSON, StartIngest, event, ndjson, post


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def producer(name: str, **limits: int) -> ProducerToken:
    return ProducerToken(name, collections=("*",), sha256=sha(name), **limits)


def bearer(name: str) -> dict[str, str]:
    return {**NDJSON, "Authorization": f"Bearer {name}"}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_event_bucket_holds_one_seconds_worth_and_refills_at_the_rate() -> None:
    clock = Clock()
    quotas = Quotas(clock)
    quotas.configure((producer("a", max_events_per_s=100),))
    assert quotas.charge("a", 60, 0) is None
    assert quotas.charge("a", 60, 0) == 1, "40 left: wait for 20 more"
    clock.t += 0.2
    assert quotas.charge("a", 60, 0) is None
    assert quotas.charge("nobody", 10**9, 10**9) is None, "no quota: no limit"


def test_a_request_bigger_than_a_second_goes_through_a_full_bucket_and_leaves_a_debt() -> None:
    clock = Clock()
    quotas = Quotas(clock)
    quotas.configure((producer("a", max_events_per_s=100, max_bytes_per_s=1000),))
    assert quotas.charge("a", 250, 10) is None
    assert quotas.admit("a") == 2, "150 events of debt and 1 more: 1.51 s"
    clock.t += 1.6
    assert quotas.admit("a") is None
    assert quotas.charge("a", 5, 2000) is None, "a full byte bucket takes a bigger request"
    assert quotas.charge("a", 5, 10) == 2, "1,000 bytes of debt and 10 more: 1.01 s"


def test_a_reload_keeps_the_bucket_of_a_producer_whose_limits_did_not_change() -> None:
    clock = Clock()
    quotas = Quotas(clock)
    quotas.configure((producer("a", max_events_per_s=100), producer("b", max_events_per_s=10)))
    assert quotas.charge("a", 100, 0) is None and quotas.charge("b", 10, 0) is None
    quotas.configure((producer("a", max_events_per_s=100), producer("b", max_events_per_s=20)))
    assert quotas.charge("a", 1, 0) == 1, "a spent its second and keeps that"
    assert quotas.charge("b", 20, 0) is None, "b has new limits: a new bucket"


async def test_over_its_quota_a_producer_gets_429_with_retry_after_and_stores_nothing(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Any, metrics: Metrics
) -> None:
    clock = Clock()
    tokens = (producer("noisy", max_events_per_s=100), producer("quiet"))
    server = await start_ingest(tokens=tokens, clock=clock)
    status, _, _ = await post(http, server, ndjson([event(i) for i in range(80)]), bearer("noisy"))
    assert status == 200
    body = ndjson([event(i) for i in range(50)])
    status, headers, doc = await post(http, server, body, bearer("noisy"))
    assert (status, doc["error"], doc["producer"]) == (429, "over_quota", "noisy")
    assert headers["Retry-After"] == "1"
    assert "max_events_per_s = 100" in doc["message"]
    assert wal.head_lsn() == 80
    status, _, _ = await post(http, server, body, bearer("quiet"))
    assert status == 200
    clock.t += 0.5
    status, _, _ = await post(http, server, body, bearer("noisy"))
    assert status == 200
    assert wal.head_lsn() == 180
    refused = metrics.ingest_quota_refusals.labels(producer="noisy")._value.get()
    accepted = {
        p: metrics.ingest_producer_events.labels(producer=p)._value.get()
        for p in ("noisy", "quiet")
    }
    assert (refused, accepted) == (1, {"noisy": 130, "quiet": 50})


# The quotas of the fairness test (events per second), and how long it floods.
NOISY_QUOTA, QUIET_QUOTA, FLOOD_S = 1000, 1000, 3.0


async def test_a_producer_over_its_rate_is_held_to_its_quota_and_another_keeps_its_own(
    start_ingest: StartIngest, wal: Any
) -> None:
    """1. "noisy" (a 1,000 events/s quota) sends 1,000-event requests from four
       connections at once for 3 s, each waiting its 429's Retry-After as
       daemon.client does.
    2. Meanwhile "quiet" (also 1,000 events/s) sends 3 s worth of 100-event
       requests, paced at its quota.
    3. noisy's accepted events stay within its quota over the time it sent
       (plus its bucket and one request's debt), and it got 429s; every one
       of quiet's requests is accepted: all of its quota's worth.

    Both bounds are against the configured rates, not a ratio of two timed
    runs, so a busy machine does not move them: it can only slow both down.
    A client that ignores Retry-After still costs the event loop a request head
    and an answer per attempt: ingest.max_connections bounds that, not quotas."""
    tokens = (
        producer("noisy", max_events_per_s=NOISY_QUOTA),
        producer("quiet", max_events_per_s=QUIET_QUOTA),
    )
    server = await start_ingest(tokens=tokens)
    url = server.url + "/v1/events"
    quiet_body = ndjson([event(i, collection="quiet") for i in range(100)])
    noisy_body = ndjson([event(i, collection="noisy") for i in range(NOISY_QUOTA)])
    codes: dict[int, int] = {}
    quiet_codes: dict[int, int] = {}

    async def quiet(session: aiohttp.ClientSession) -> int:
        """FLOOD_S seconds' worth of requests, paced at quiet's quota (a late
        one goes at once); returns the events accepted."""
        accepted = 0
        started = time.monotonic()
        for sent in range(int(QUIET_QUOTA * FLOOD_S) // 100):
            await asyncio.sleep(max(started + sent * 100 / QUIET_QUOTA - time.monotonic(), 0.0))
            async with session.post(url, data=quiet_body, headers=bearer("quiet")) as resp:
                await resp.read()
                quiet_codes[resp.status] = quiet_codes.get(resp.status, 0) + 1
                accepted += 100 if resp.status == 200 else 0
        return accepted

    async def noisy(session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            async with session.post(url, data=noisy_body, headers=bearer("noisy")) as resp:
                await resp.read()
                codes[resp.status] = codes.get(resp.status, 0) + 1
                wait = float(resp.headers.get("Retry-After", "0"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)

    async with aiohttp.ClientSession() as quiet_session, aiohttp.ClientSession() as session:
        stop = asyncio.Event()
        started = time.monotonic()
        flood = [asyncio.create_task(noisy(session, stop)) for _ in range(4)]
        quiet_events = await quiet(quiet_session)
        stop.set()
        await asyncio.gather(*flood)
        took = time.monotonic() - started

    noisy_events = codes.get(200, 0) * NOISY_QUOTA
    assert codes.get(429, 0) > codes.get(200, 0), codes
    # The rate over the seconds it sent, its full bucket at the start, one request's debt.
    assert noisy_events <= NOISY_QUOTA * (took + 2), (noisy_events, took, codes)
    assert quiet_codes.keys() == {200} and quiet_events == QUIET_QUOTA * FLOOD_S, quiet_codes
