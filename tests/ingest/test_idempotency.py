"""Idempotent requests: a retry with the same Idempotency-Key and body is answered from the
first request and stores nothing; the same key with another body is refused; a retry that
arrives while the first attempt is being stored waits for its outcome."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp

from daemon.ingest.server import IngestServer
from daemon.service.metrics import Metrics
from tests.ingest.conftest import NDJSON, StartIngest, event, ndjson, open_wal, post, stored
from wal import Wal
from wal.errors import WalFullError


def keyed(key: str) -> dict[str, str]:
    return {**NDJSON, "Idempotency-Key": key}


BODY = ndjson([event(i) for i in range(50)])


class HeldAppend:
    """A stand-in for ``wal.append`` whose first call waits for ``release``; with
    ``first_fails`` that call then fails as a full volume, stores nothing."""

    def __init__(self, wal: Wal, *, first_fails: bool = False) -> None:
        self.real = wal.append
        self.directory = wal.directory
        self.first_fails = first_fails
        self.release = asyncio.Event()
        self.calls = 0

    async def append(self, items: Any, request: Any = None) -> tuple[int, int]:
        self.calls += 1
        if self.calls == 1:
            await self.release.wait()
            if self.first_fails:
                raise WalFullError(str(self.directory), 1000, 0, "ENOSPC: injected")
        result: tuple[int, int] = await self.real(items, request)
        return result


async def test_a_retry_with_the_same_key_is_answered_from_the_first_and_not_stored_again(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Wal, metrics: Metrics
) -> None:
    status, headers, first = await post(http, ingest, BODY, keyed("order-batch-1"))
    assert status == 200 and "replayed" not in first
    assert "Idempotent-Replayed" not in headers
    await post(http, ingest, ndjson([event(99)]))  # something else in between
    status, headers, again = await post(http, ingest, BODY, keyed("order-batch-1"))
    assert status == 200
    assert headers["Idempotent-Replayed"] == "true"
    assert again == {**first, "replayed": True}
    assert wal.head_lsn() == 51, "the retry stored nothing"
    assert metrics.ingest_replays._value.get() == 1


async def test_the_same_key_with_another_body_is_refused_and_nothing_is_stored(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    status, _, first = await post(http, ingest, BODY, keyed("k-1"))
    assert status == 200
    status, _, err = await post(http, ingest, ndjson([event(7)]), keyed("k-1"))
    assert status == 422
    assert err["error"] == "idempotency_key_reused"
    assert err["key"] == "k-1"
    assert f"LSN {first['first_lsn']}..{first['last_lsn']}" in err["message"]
    assert wal.head_lsn() == 50


async def test_the_same_body_as_json_and_as_ndjson_are_different_requests(
    ingest: IngestServer, http: aiohttp.ClientSession
) -> None:
    """The digest covers the content type: one key, two parses of the bytes, is a reuse."""
    body = b'[{"collection":"c","op":"delete","key":"a"}]'
    status, _, _ = await post(
        http, ingest, body, {"Content-Type": "application/json", "Idempotency-Key": "t"}
    )
    assert status == 200
    status, _, err = await post(http, ingest, body, keyed("t"))
    assert status == 422 and err["error"] == "idempotency_key_reused"


async def test_a_retry_while_the_first_attempt_is_in_flight_waits_for_its_outcome(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    held = HeldAppend(wal)
    with mock.patch.object(wal, "append", side_effect=held.append):
        attempts = [
            asyncio.ensure_future(post(http, ingest, BODY, keyed("slow"))) for _ in range(3)
        ]
        await asyncio.sleep(0.3)
        assert not any(a.done() for a in attempts), "the retries answered before the first"
        assert held.calls == 1, "a retry started a second append of the same key"
        held.release.set()
        answers = await asyncio.wait_for(asyncio.gather(*attempts), 10.0)
    assert [status for status, _, _ in answers] == [200, 200, 200]
    lsns = {(ack["first_lsn"], ack["last_lsn"]) for _, _, ack in answers}
    assert lsns == {(1, 50)}
    assert sorted(bool(ack.get("replayed")) for _, _, ack in answers) == [False, True, True]
    assert wal.head_lsn() == 50


async def test_a_retry_waiting_on_a_first_attempt_that_failed_stores_the_request_itself(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    held = HeldAppend(wal, first_fails=True)
    with mock.patch.object(wal, "append", side_effect=held.append):
        first = asyncio.ensure_future(post(http, ingest, BODY, keyed("retry-me")))
        await asyncio.sleep(0.2)
        retry = asyncio.ensure_future(post(http, ingest, BODY, keyed("retry-me")))
        await asyncio.sleep(0.2)
        held.release.set()
        (s1, _, a1), (s2, _, a2) = await asyncio.wait_for(asyncio.gather(first, retry), 10.0)
    assert s1 == 507 and a1["error"] == "wal_full"
    assert s2 == 200 and "replayed" not in a2 and (a2["first_lsn"], a2["last_lsn"]) == (1, 50)
    assert len(stored(wal)) == 50


async def test_a_retry_after_a_restart_is_still_recognised(
    tmp_path: Path, start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Wal
) -> None:
    ingest = await start_ingest()
    status, _, first = await post(http, ingest, BODY, keyed("across-restart"))
    assert status == 200
    await ingest.stop(1.0)
    await wal.aclose()
    reopened = await asyncio.to_thread(open_wal, tmp_path / "wal")
    try:
        again = await start_ingest(wal_=reopened)
        status, _, ack = await post(http, again, BODY, keyed("across-restart"))
        assert status == 200 and ack == {**first, "replayed": True}
        assert reopened.head_lsn() == 50
    finally:
        await again.stop(1.0)
        await reopened.aclose()


async def test_a_retry_after_the_window_is_stored_again(
    tmp_path: Path, start_ingest: StartIngest, http: aiohttp.ClientSession
) -> None:
    """Documented: the window is bounded; past it a key is new again."""
    short = await asyncio.to_thread(
        Wal.open, tmp_path / "short", request_window_s=0.3, request_max_keys=100
    )
    try:
        ingest = await start_ingest(wal_=short)
        status, _, first = await post(http, ingest, BODY, keyed("late"))
        await asyncio.sleep(0.5)
        status, _, again = await post(http, ingest, BODY, keyed("late"))
        assert status == 200 and "replayed" not in again
        assert again["first_lsn"] == first["last_lsn"] + 1
    finally:
        await short.aclose()


async def test_a_bad_idempotency_key_is_refused_with_what_is_wrong(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Wal
) -> None:
    ingest = await start_ingest(max_idempotency_key_bytes=8)
    for key in ("has space", "123456789", "caf\u00e9"):
        headers = keyed(key.encode("utf-8").decode("latin-1"))
        status, _, err = await post(http, ingest, BODY, headers)
        assert status == 400, key
        assert err["error"] == "bad_idempotency_key" and err["limit"] == 8
        assert "ingest.max_idempotency_key_bytes" in err["message"]
    assert wal.head_lsn() == 0
