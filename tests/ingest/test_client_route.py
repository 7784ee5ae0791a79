"""``route="key"``: each (collection, key) to one endpoint (docs/ingest.md, "Clients and retries").

Unit tests of the rendezvous choice, then real ingest servers on loopback,
each on its own WAL, and ports where nothing listens (a daemon that is down).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from daemon.client import (
    Client,
    EndpointAck,
    IngestConnectionError,
    InvalidEventsError,
    Retry,
    RoutedAck,
    StandbyError,
    SyncIngestClient,
    UnroutableError,
    key_endpoint,
    pick_endpoint,
    route_weight,
    sub_key,
)
from daemon.config import Listen
from daemon.ingest.server import IngestServer
from tests.conftest import free_port
from tests.ingest.conftest import StartIngest, event, ndjson, open_wal, stored
from tests.ingest.test_client_send import run_send
from wal import Wal

ROOT = Path(__file__).resolve().parents[2]
KEYS = [f"user-{n}" for n in range(30)]

# -- the rendezvous choice ----------------------------------------------------------------

URLS3 = [f"http://10.0.0.{i}:8470/v1/events" for i in (1, 2, 3)]
URLS4 = [*URLS3, "http://10.0.0.4:8470/v1/events"]
MANY = [f"key-{n}" for n in range(10_000)]


def picks(urls: list[str], keys: list[str] = MANY) -> list[str]:
    return [urls[pick_endpoint("orders", k, urls)] for k in keys]


def test_the_weight_of_a_key_is_a_fixed_number_in_every_release() -> None:
    """BLAKE2b of ``collection\\0key\\0url``: pinned, so an upgrade moves no key."""
    assert route_weight("orders", "k1", "http://127.0.0.1:1/v1/events") == 2304971708142034002
    assert sub_key("abc", "http://127.0.0.1:1/v1/events") == "abc/89e84c04"


def test_another_process_with_another_hash_seed_picks_the_same_endpoints() -> None:
    code = (
        "import sys; from daemon.client import pick_endpoint; "
        f"urls = {URLS4!r}; "
        "print(','.join(str(pick_endpoint('orders', f'key-{n}', urls)) for n in range(2000)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    here = ",".join(str(pick_endpoint("orders", k, URLS4)) for k in MANY[:2000])
    assert out == here


def test_keys_spread_over_every_endpoint() -> None:
    counts = {u: 0 for u in URLS3}
    for u in picks(URLS3):
        counts[u] += 1
    assert all(2_800 < n < 3_900 for n in counts.values()), counts


def test_adding_a_fourth_endpoint_moves_about_a_quarter_of_the_keys_all_to_it() -> None:
    before, after = picks(URLS3), picks(URLS4)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert 0.15 <= len(moved) / len(MANY) <= 0.35, len(moved)
    assert {a for _, a in moved} == {URLS4[3]}


def test_removing_an_endpoint_moves_only_its_keys() -> None:
    removed = URLS4[1]
    rest = [u for u in URLS4 if u != removed]
    before, after = picks(URLS4), picks(rest)
    for b, a in zip(before, after, strict=True):
        if b != removed:
            assert a == b
    landed = {a for b, a in zip(before, after, strict=True) if b == removed}
    assert landed == set(rest), "the removed endpoint's keys spread over the others"


def test_the_same_url_spelled_two_ways_is_one_endpoint() -> None:
    assert key_endpoint("orders", "k", ["127.0.0.1:1", "http://127.0.0.1:2/"]) in (
        "http://127.0.0.1:1/v1/events",
        "http://127.0.0.1:2/v1/events",
    )
    with pytest.raises(ValueError, match="distinct endpoints"):
        SyncIngestClient(endpoints=["127.0.0.1:1", "http://127.0.0.1:1/"], route="key")


def test_an_unknown_route_and_an_overlong_key_are_refused() -> None:
    with pytest.raises(ValueError, match="route is one of 'order', 'key', got 'nearest'"):
        SyncIngestClient(endpoints=["http://127.0.0.1:1"], route="nearest")  # type: ignore[call-overload]
    client = SyncIngestClient(endpoints=["http://127.0.0.1:1"], route="key")
    with client, pytest.raises(ValueError, match="a key is at most 246 characters, got 247"):
        client.send([event(1)], key="k" * 247)


# -- real servers ------------------------------------------------------------------------


@pytest.fixture
async def wals(tmp_path: Path, wal: Wal) -> AsyncIterator[list[Wal]]:
    """Three WALs: the ``wal`` fixture's and two more."""
    more = [await asyncio.to_thread(open_wal, tmp_path / f"wal-{i}") for i in (1, 2)]
    yield [wal, *more]
    for w in more:
        await w.aclose()


def events_url(base: str) -> str:
    return base + "/v1/events"


def by_key(w: Wal) -> dict[str, list[int]]:
    """The ``new.id`` of each key's events, in LSN order."""
    got: dict[str, list[int]] = {}
    for _, _, e in stored(w):
        assert e.new is not None
        got.setdefault(e.key, []).append(msgspec.json.decode(e.new)["id"])
    return got


def keyed_events(
    rounds: int, keys: list[str] = KEYS
) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """Events of every key, interleaved round by round; and each key's ids in order."""
    events: list[dict[str, Any]] = []
    order: dict[str, list[int]] = {}
    for r in range(rounds):
        for n, k in enumerate(keys):
            i = r * 1000 + n
            events.append(event(i, key=k, op="insert" if r == 0 else "update"))
            order.setdefault(k, []).append(i)
    return events, order


RoutedSend = Callable[..., Awaitable[tuple[RoutedAck, list[Retry]]]]


@pytest.fixture(params=["async", "sync"])
def routed_send(request: pytest.FixtureRequest) -> RoutedSend:
    """``send(endpoints, body, key=None, on_sleep=..., **kw)`` through either client with
    ``route="key"``: the ack and every ``on_retry`` call. ``on_sleep`` runs on the
    loop instead of each wait."""
    flavour = request.param

    async def send(
        endpoints: list[str],
        body: bytes,
        *,
        key: str | None = None,
        on_sleep: Callable[[float], Awaitable[None]] | None = None,
        **kw: Any,
    ) -> tuple[RoutedAck, list[Retry]]:
        loop = asyncio.get_running_loop()
        retries: list[Retry] = []

        async def nap(s: float) -> None:
            if on_sleep is not None:
                await on_sleep(s)

        if flavour == "async":
            async with Client(
                endpoints=endpoints, route="key", sleep=nap, on_retry=retries.append, **kw
            ) as c:
                return await c.send_ndjson(body, key=key), retries

        def sync_nap(s: float) -> None:
            asyncio.run_coroutine_threadsafe(nap(s), loop).result()

        def run() -> RoutedAck:
            with SyncIngestClient(
                endpoints=endpoints, route="key", sleep=sync_nap, on_retry=retries.append, **kw
            ) as c:
                return c.send_ndjson(body, key=key)

        return await asyncio.to_thread(run), retries

    return send


async def test_the_events_of_one_key_all_reach_one_endpoint_in_order(
    start_ingest: StartIngest, wals: list[Wal], routed_send: RoutedSend
) -> None:
    servers = [await start_ingest(wal_=w) for w in wals]
    urls = [s.url for s in servers]
    events, order = keyed_events(4)
    acks = []
    for r in range(2):  # two requests, two rounds of every key each
        ack, retries = await routed_send(
            urls, ndjson(events[r * 60 : (r + 1) * 60]), key=f"req-{r}"
        )
        assert retries == []
        acks.append(ack)
    placed: dict[str, list[int]] = {}
    for i, w in enumerate(wals):
        got = by_key(w)
        assert got, f"endpoint {i} got no key"
        for k, ids in got.items():
            assert k not in placed, f"{k} reached two endpoints"
            assert key_endpoint("orders", k, urls) == events_url(urls[i])
            placed[k] = ids
    assert placed == order, "every key's events, in the order sent"
    for r, ack in enumerate(acks):
        assert ack.accepted == 60
        assert [a.endpoint for a in ack.acks] == [events_url(u) for u in urls]
        for a, w in zip(ack.acks, wals, strict=True):
            assert isinstance(a, EndpointAck) and not a.replayed
            assert a.key == sub_key(f"req-{r}", a.endpoint)
            assert w.find_request(a.key.encode()) is not None
            assert a.last_lsn - a.first_lsn + 1 == a.accepted
        assert sum(w.head_lsn() for w in wals) == 120


@pytest.mark.parametrize("outage", ["down", "standby"])
async def test_a_down_endpoints_keys_are_retried_there_and_land_once_it_is_back(
    start_ingest: StartIngest, wals: list[Wal], routed_send: RoutedSend, outage: str
) -> None:
    """Endpoint 0 is down (nothing listens) or a standby (503 standby): its
    sub-request waits and tries endpoint 0 again, never another; during the
    first wait it comes back, and its keys land there, once."""
    live = [await start_ingest(wal_=w) for w in wals[1:]]
    first: IngestServer | None = None
    if outage == "down":
        port = free_port()
        url0 = f"http://127.0.0.1:{port}"
    else:
        first = await start_ingest(wal_=wals[0])
        first.standby = lambda: "db-a.example"
        url0 = first.url

    async def come_back(s: float) -> None:
        if first is not None:
            first.standby = None
        elif not back:
            back.append(await start_ingest(wal_=wals[0], listen=Listen("127.0.0.1", port)))

    back: list[IngestServer] = []
    urls = [url0, *(s.url for s in live)]
    events, order = keyed_events(2)
    ack, retries = await routed_send(urls, ndjson(events), on_sleep=come_back)
    mine = {k for k in KEYS if key_endpoint("orders", k, urls) == events_url(url0)}
    assert mine and len(mine) < len(KEYS)
    assert retries, "endpoint 0's sub-request was retried"
    assert {r.endpoint for r in retries} == {events_url(url0)}
    want = IngestConnectionError if outage == "down" else StandbyError
    assert all(isinstance(r.error, want) for r in retries)
    assert by_key(wals[0]) == {k: order[k] for k in mine}
    for w in wals[1:]:
        assert not set(by_key(w)) & mine, "endpoint 0's keys never land elsewhere"
    assert sum(w.head_lsn() for w in wals) == len(events)
    assert ack.accepted == len(events) and wals[0].request_keys() == 1


async def test_the_other_endpoints_keys_are_not_held_back_by_a_down_one(
    start_ingest: StartIngest, wals: list[Wal], routed_send: RoutedSend
) -> None:
    """Endpoint 0 is down; while its sub-request waits, the others' sub-requests
    are acknowledged (the wait checks their WALs before endpoint 0 comes up)."""
    port = free_port()
    live = [await start_ingest(wal_=w) for w in wals[1:]]
    urls = [f"http://127.0.0.1:{port}", *(s.url for s in live)]
    events, _ = keyed_events(2)
    want = [
        sum(1 for e in events if key_endpoint("orders", e["key"], urls) == events_url(u))
        for u in urls
    ]
    assert all(want)
    stored_meanwhile: list[list[int]] = []
    back: list[IngestServer] = []

    async def wait_for_the_others(s: float) -> None:
        if back:
            return
        for _ in range(100):
            if [w.head_lsn() for w in wals[1:]] == want[1:]:
                break
            await asyncio.sleep(0.05)
        stored_meanwhile.append([w.head_lsn() for w in wals])
        back.append(await start_ingest(wal_=wals[0], listen=Listen("127.0.0.1", port)))

    ack, _ = await routed_send(urls, ndjson(events), on_sleep=wait_for_the_others)
    assert stored_meanwhile == [[0, *want[1:]]]
    assert [w.head_lsn() for w in wals] == want
    assert [a.accepted for a in ack.acks] == want


async def test_out_of_retries_at_a_down_endpoint_names_it_and_a_resend_stores_nothing_twice(
    start_ingest: StartIngest, wals: list[Wal], routed_send: RoutedSend
) -> None:
    """1. Endpoint 0 stays down past ``retry_for_s``: its connection error is raised,
       naming it, carrying the other endpoints' acks.
    2. It comes up; the same request with the same key: endpoints 1 and 2 answer
       replays (their sub-requests' keys are the same), endpoint 0 stores its part."""
    port = free_port()
    live = [await start_ingest(wal_=w) for w in wals[1:]]
    urls = [f"http://127.0.0.1:{port}", *(s.url for s in live)]
    events, _ = keyed_events(2)
    body = ndjson(events)
    with pytest.raises(IngestConnectionError) as err:
        await routed_send(urls, body, key="batch-7", retry_for_s=1.0)
    exc = err.value
    assert exc.endpoint == events_url(urls[0]) and exc.gave_up and not exc.maybe_stored
    assert f"at {events_url(urls[0])}" in str(exc)
    assert exc.key == "batch-7"
    assert [a.endpoint for a in exc.acked] == [events_url(u) for u in urls[1:]]
    heads = [w.head_lsn() for w in wals]
    assert heads[0] == 0 and all(heads[1:])

    await start_ingest(wal_=wals[0], listen=Listen("127.0.0.1", port))
    ack, _ = await routed_send(urls, body, key="batch-7")
    assert [a.replayed for a in ack.acks] == [False, True, True]
    assert [w.head_lsn() for w in wals][1:] == heads[1:], "stored once"
    assert sum(w.head_lsn() for w in wals) == len(events)


async def test_a_refusal_names_the_line_of_the_whole_request_and_its_endpoint(
    start_ingest: StartIngest, wals: list[Wal], routed_send: RoutedSend
) -> None:
    servers = [await start_ingest(wal_=w) for w in wals]
    urls = [s.url for s in servers]
    events, _ = keyed_events(1)
    bad = events[12]
    del bad["new"]  # an insert without "new": 422 at its endpoint, line 13, event 12
    with pytest.raises(InvalidEventsError) as err:
        await routed_send(urls, ndjson(events))
    exc = err.value
    assert exc.endpoint == key_endpoint("orders", bad["key"], urls)
    assert exc.errors == [
        {"index": 12, "line": 13, "field": "new", "reason": 'an insert needs the "new" object'}
    ]
    assert len(exc.acked) == 2 and exc.endpoint not in {a.endpoint for a in exc.acked}


async def test_an_event_without_a_key_sends_nothing_and_names_its_line(
    start_ingest: StartIngest, wals: list[Wal], routed_send: RoutedSend
) -> None:
    servers = [await start_ingest(wal_=w) for w in wals]
    events, _ = keyed_events(1)
    del events[2]["key"]
    with pytest.raises(UnroutableError) as err:
        await routed_send([s.url for s in servers], ndjson(events))
    assert (err.value.line, err.value.index) == (3, 2)
    assert "line 3 (event 2) has none to route by" in str(err.value)
    assert "missing required field `key`" in str(err.value)
    assert [w.head_lsn() for w in wals] == [0, 0, 0]


# -- eventplane send --route key ---------------------------------------------------------


async def test_send_route_key_spreads_stdin_by_key_and_keeps_each_keys_order(
    start_ingest: StartIngest, wals: list[Wal], tmp_path: Path
) -> None:
    servers = [await start_ingest(wal_=w) for w in wals]
    urls = [s.url for s in servers]
    events, order = keyed_events(3)
    code, out, err = await run_send(
        tmp_path,
        urls[0],
        ndjson(events),
        "--url",
        urls[1],
        "--url",
        urls[2],
        "--route",
        "key",
        "--batch",
        "25",
        "--key-prefix",
        "rk",
    )
    assert code == 0, err
    assert out.startswith("sent 90 events in 4 requests, LSN 1..")
    for u, w in zip(urls, wals, strict=True):
        assert f"..{w.head_lsn()} at {events_url(u)}" in out
        assert w.find_request(sub_key("rk:1", events_url(u)).encode()) is not None
    placed: dict[str, list[int]] = {}
    for u, w in zip(urls, wals, strict=True):
        for k, ids in by_key(w).items():
            assert key_endpoint("orders", k, urls) == events_url(u)
            placed[k] = ids
    assert placed == order


async def test_send_route_key_out_of_retries_prints_a_resend_that_completes_the_batch(
    start_ingest: StartIngest, wals: list[Wal], tmp_path: Path
) -> None:
    port = free_port()
    down = f"http://127.0.0.1:{port}"
    live = [await start_ingest(wal_=w) for w in wals[1:]]
    events, order = keyed_events(1)
    args = ["--url", live[0].url, "--url", live[1].url, "--route", "key", "--key-prefix", "rk"]
    code, _, err = await run_send(tmp_path, down, ndjson(events), *args, "--retry-for", "0.5")
    assert code == 1
    assert "request 1 (stdin lines 1-30): gave up after " in err
    assert f" at {events_url(down)}; the last: cannot connect to {events_url(down)}" in err
    assert f"at {events_url(live[0].url)}" in err and "were acknowledged" in err
    resend = f"--url {live[1].url} --route key --key-prefix rk --from-line 1"
    assert resend in err
    heads = [w.head_lsn() for w in wals]

    await start_ingest(wal_=wals[0], listen=Listen("127.0.0.1", port))
    code, out, err = await run_send(tmp_path, down, ndjson(events), *args)
    assert code == 0, err
    assert "(1 replayed)" not in out, "endpoint 0's part was new"
    assert [w.head_lsn() for w in wals][1:] == heads[1:], "the acknowledged parts replayed"
    placed = {k: ids for w in wals for k, ids in by_key(w).items()}
    assert placed == order


async def test_send_route_key_refuses_a_line_without_a_key_before_sending_it(
    start_ingest: StartIngest, wals: list[Wal], tmp_path: Path
) -> None:
    servers = [await start_ingest(wal_=w) for w in wals]
    events, _ = keyed_events(1)
    del events[1]["key"]
    code, _, err = await run_send(
        tmp_path, servers[0].url, ndjson(events), "--url", servers[1].url, "--route", "key"
    )
    assert code == 1
    assert (
        "request 1 (stdin lines 1-30) not sent: --route key sends each event by its collection "
        "and key, and stdin line 2 has none to route by: Object missing required field `key`"
    ) in err
    assert "to send the rest: tail -n +1" in err
    assert [w.head_lsn() for w in wals] == [0, 0, 0]
