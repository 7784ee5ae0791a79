"""Appends come back from read() and read_batches() exactly, in LSN order, across reopen and
rotation; the listener sees every durable group before its acks; bad input is refused."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from array import array
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from tests.wal.helpers import OpenWal, events
from wal import Record, Wal, WalClosedError, WalLockedError
from wal.format import CoreSections, EncodedSection, check_positions, sections_of
from wal.reader import RecordBatch


async def test_concurrent_appends_get_consecutive_lsns_and_read_back_in_order(
    open_wal: OpenWal,
) -> None:
    wal = open_wal(segment_bytes=16 * 1024)
    batches = [events(37, tag=f"b{k}") for k in range(40)]
    ranges: list[tuple[int, int]] = []
    for wave in range(0, 40, 5):  # waves, so there are several groups (and segments)
        ranges += await asyncio.gather(*(wal.append(b) for b in batches[wave : wave + 5]))
    assert sorted(ranges)[0][0] == 1
    for (first, last), batch in zip(ranges, batches, strict=True):
        assert last - first + 1 == len(batch)
        got = list(wal.read(first, to_lsn=last))
        assert [(r.core, r.payload) for r in got] == batch
    assert [r.lsn for r in wal.read(1)] == list(range(1, 40 * 37 + 1))
    assert wal.head_lsn() == 40 * 37
    assert wal.segment_count() > 1


def test_reopen_keeps_every_record_and_restarts_sequences(open_wal: OpenWal, wal_dir: Path) -> None:
    wal = open_wal(segment_bytes=8 * 1024)
    for k in range(20):
        wal.append_blocking(events(50, tag=f"r{k}"))
    before = list(wal.read(1))
    wal_id = wal.wal_id
    wal.close()
    again = open_wal(segment_bytes=8 * 1024)
    assert again.wal_id == wal_id
    assert (wal_dir / "IDENTITY").read_text().strip() == wal_id
    assert list(again.read(1)) == before
    first, last = again.append_blocking([(2, b"after")])
    assert (first, last) == (1001, 1001)
    assert list(again.read(first)) == [Record(1001, 2, 1, b"after")]


def test_sequences_are_per_core_and_consecutive(open_wal: OpenWal) -> None:
    wal = open_wal()
    wal.append_blocking([(3, b"a"), (1, b"b"), (3, b"c")])
    wal.append_blocking([(1, b"d"), (3, b"e")])
    assert [(r.core, r.seq) for r in wal.read(1)] == [(3, 1), (1, 1), (3, 2), (1, 2), (3, 3)]


batch_strategy = st.lists(
    st.lists(
        st.tuples(st.integers(0, 7), st.binary(min_size=0, max_size=300)), min_size=1, max_size=60
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches=batch_strategy, data=st.data())
def test_random_batches_read_back_whole_per_core_and_by_range(
    tmp_path_factory: pytest.TempPathFactory,
    batches: list[list[tuple[int, bytes]]],
    data: st.DataObject,
) -> None:
    directory = tmp_path_factory.mktemp("hyp")
    model: list[tuple[int, bytes]] = [item for batch in batches for item in batch]
    with Wal.open(directory, segment_bytes=4096) as wal:
        for batch in batches:
            wal.append_blocking(batch)
        expected = []
        seqs: dict[int, int] = {}
        for lsn, (core, payload) in enumerate(model, 1):
            seqs[core] = seqs.get(core, 0) + 1
            expected.append(Record(lsn, core, seqs[core], payload))
        assert list(wal.read(1)) == expected
        for core in range(8):
            mine = [r for r in expected if r.core == core]
            assert list(wal.read(1, core=core)) == mine
            batched = [r for b in wal.read_batches(1, core=core) for r in b.records()]
            assert batched == mine
        lo = data.draw(st.integers(1, len(model)))
        hi = data.draw(st.integers(lo, len(model)))
        core = data.draw(st.one_of(st.none(), st.integers(0, 7)))
        want = [r for r in expected[lo - 1 : hi] if core is None or r.core == core]
        assert list(wal.read(lo, core=core, to_lsn=hi)) == want
        got = sorted(
            (r for b in wal.read_batches(lo, core=core, to_lsn=hi) for r in b.records()),
            key=lambda r: r.lsn,
        )
        assert got == want
    with Wal.open(directory, segment_bytes=4096) as again:
        assert list(again.read(1)) == expected


def test_record_batches_expose_arrow_style_columns(open_wal: OpenWal) -> None:
    wal = open_wal()
    wal.append_blocking([(0, b"aa"), (1, b"b"), (0, b""), (0, b"cccc")])
    (batch,) = list(wal.read_batches(1, core=0))
    assert list(batch.lsns) == [1, 3, 4]
    assert list(batch.seqs) == [1, 2, 3]
    assert list(batch.offsets) == [0, 2, 2, 6]
    assert batch.data == b"aacccc"
    assert batch.payloads() == [b"aa", b"", b"cccc"]
    assert batch.payload(2) == b"cccc"


async def test_listener_sees_each_durable_group_on_the_loop_before_the_acks(
    open_wal: OpenWal,
) -> None:
    wal = open_wal()
    loop_thread = threading.get_ident()
    seen: list[Record] = []
    acks: list[tuple[int, int]] = []
    early_acks: list[tuple[int, int]] = []

    def listener(records: list[Record]) -> None:
        assert threading.get_ident() == loop_thread
        lo, hi = records[0].lsn, records[-1].lsn
        early_acks.extend(a for a in acks if lo <= a[0] <= hi)
        seen.extend(records)

    wal.set_listener(listener)

    async def one(k: int) -> None:
        acks.append(await wal.append(events(10, tag=f"l{k}")))

    for wave in range(0, 30, 6):
        await asyncio.gather(*(one(k) for k in range(wave, wave + 6)))
    assert early_acks == []  # no append returned before its group reached the listener
    assert seen == list(wal.read(1))
    assert [r.lsn for r in seen] == list(range(1, 301))


async def test_listener_failure_is_logged_and_the_append_still_acknowledged(
    open_wal: OpenWal,
) -> None:
    wal = open_wal()

    def broken(records: list[Record]) -> None:
        raise RuntimeError("ring full of bugs")

    wal.set_listener(broken)
    with capture_logs() as logs:
        assert await wal.append([(0, b"x")]) == (1, 1)
    assert any(e["event"] == "wal.listener_failed" for e in logs)
    assert [r.lsn for r in wal.read(1)] == [1]


def test_on_group_observer_gets_events_bytes_and_fsync_time(open_wal: OpenWal) -> None:
    wal = open_wal()
    seen: list[tuple[int, int, float]] = []
    wal.on_group = lambda n, size, seconds: seen.append((n, size, seconds))
    wal.append_blocking(events(5))
    assert len(seen) == 1 and seen[0][0] == 5 and seen[0][1] > 5 and seen[0][2] >= 0


@pytest.mark.parametrize("mode", ["interval", "never"])
async def test_relaxed_fsync_modes_round_trip(open_wal: OpenWal, wal_dir: Path, mode: str) -> None:
    wal = open_wal(fsync=mode, fsync_interval_ms=5, segment_bytes=4096)
    for k in range(20):
        await wal.append(events(20, tag=f"{mode}{k}"))
    before = list(wal.read(1))
    await wal.aclose()
    assert list(open_wal(fsync=mode).read(1)) == before


@pytest.mark.parametrize(
    ("items", "error"),
    [
        ([], ValueError),
        ([(-1, b"x")], ValueError),
        ([(2**32, b"x")], ValueError),
        ([("0", b"x")], ValueError),
        ([(0, "text")], TypeError),
        ([(0, bytearray(b"x"))], TypeError),
    ],
)
def test_malformed_appends_are_refused_without_harming_the_log(
    open_wal: OpenWal, items: list[tuple[object, object]], error: type[Exception]
) -> None:
    wal = open_wal()
    with pytest.raises(error):
        wal.append_blocking(items)  # type: ignore[arg-type]
    assert wal.append_blocking([(0, b"fine")]) == (1, 1)


async def test_aclose_flushes_pending_appends_then_refuses_new_ones(open_wal: OpenWal) -> None:
    wal = open_wal()
    pending = [asyncio.ensure_future(wal.append(events(3, tag=str(k)))) for k in range(20)]
    await asyncio.sleep(0)
    await wal.aclose()
    assert sorted(await asyncio.gather(*pending))[-1][1] == 60
    with pytest.raises(WalClosedError):
        await wal.append([(0, b"late")])
    with pytest.raises(WalClosedError):
        wal.append_blocking([(0, b"late")])


def test_second_open_of_the_same_directory_is_refused(open_wal: OpenWal) -> None:
    open_wal()
    with pytest.raises(WalLockedError, match="in use"):
        open_wal()


def test_readers_on_other_threads_see_a_gapless_prefix_while_appends_run(
    open_wal: OpenWal,
) -> None:
    wal = open_wal(segment_bytes=8 * 1024)
    stop = threading.Event()
    problems: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            head = wal.head_lsn()
            lsns = [r.lsn for r in wal.read(1)]
            if lsns != list(range(1, len(lsns) + 1)) or len(lsns) < head:
                problems.append(f"read {len(lsns)} records, head was {head}")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for k in range(150):
        wal.append_blocking(events(7, tag=str(k)))
    stop.set()
    for t in threads:
        t.join()
    assert problems == []
    assert wal.head_lsn() == 1050


def test_read_above_the_head_is_empty_and_head_of_new_log_is_zero(open_wal: OpenWal) -> None:
    wal = open_wal()
    assert wal.head_lsn() == 0
    assert wal.retained_floor() == 1
    assert list(wal.read(1)) == []
    wal.append_blocking([(0, b"x")])
    assert list(wal.read(2)) == []
    assert list(wal.read(1, to_lsn=0)) == []


def test_closing_a_read_releases_its_segment_file(open_wal: OpenWal) -> None:
    wal = open_wal(segment_bytes=4096)
    for k in range(40):
        wal.append_blocking(events(10, tag=str(k)))
    fds_before = len(os.listdir("/proc/self/fd"))
    with wal.read(1) as it:
        assert next(it).lsn == 1
        assert len(os.listdir("/proc/self/fd")) > fds_before  # its segment is open
    assert len(os.listdir("/proc/self/fd")) == fds_before
    batches = wal.read_batches(1, core=2)
    assert next(batches).core == 2
    batches.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before


async def test_interval_mode_acks_before_fsync_and_syncs_within_the_interval(
    open_wal: OpenWal,
) -> None:
    wal = open_wal(fsync="interval", fsync_interval_ms=50)
    with mock.patch.object(os, "fdatasync", wraps=os.fdatasync) as synced:
        for k in range(20):
            await wal.append(events(2, tag=str(k)))
        assert synced.call_count < 20  # not one per group
        for _ in range(100):
            if synced.call_count:
                break
            await asyncio.sleep(0.01)
        assert synced.call_count >= 1  # the writer synced on its own within the interval


async def test_max_group_bytes_bounds_a_group_but_never_splits_an_append(
    open_wal: OpenWal,
) -> None:
    wal = open_wal(max_group_bytes=2000)
    groups: list[int] = []
    wal.on_group = lambda n, size, seconds: groups.append(n)
    big = [(0, b"x" * 100)] * 50  # 5400 bytes: more than a group, still one frame
    results = await asyncio.gather(
        wal.append(big), *(wal.append([(1, b"y" * 100)] * 5) for _ in range(20))
    )
    assert results[0][1] - results[0][0] == 49
    assert 50 in groups  # the big append went alone, whole
    # 5-event appends weigh 5 * (100 + 8) bytes: at most 3 fit in 2000 bytes.
    assert max(g for g in groups if g != 50) <= 15
    assert [r.lsn for r in wal.read(1)] == list(range(1, 151))


def test_frames_bigger_than_a_read_chunk_read_back_from_the_active_and_sealed_segments(
    open_wal: OpenWal,
) -> None:
    wal = open_wal(segment_bytes=1 << 20)
    small = events(30)
    big = [(i % 3, bytes([i]) * 100_000) for i in range(50)]  # one 5 MB frame > 4 MiB chunk
    wal.append_blocking(small)
    wal.append_blocking(big)
    wal.append_blocking(small)
    expected = [*small, *big, *small]
    assert [(r.core, r.payload) for r in wal.read(1)] == expected  # active segment: pread
    wal.append_blocking(events(1))  # rotates: the big frame's segment is sealed (mmap)
    assert wal.segment_count() >= 2
    assert [(r.core, r.payload) for r in wal.read(1, to_lsn=len(expected))] == expected


async def test_batch_listener_gets_each_group_as_one_batch_per_core_with_the_logged_events(
    open_wal: OpenWal,
) -> None:
    """The columnar listener sees exactly what a reader of the log sees: every
    event once, its LSN, core, sequence and payload, one batch per core and
    group, cores ascending; one-core groups and mixed groups alike."""
    wal = open_wal()
    groups: list[list[RecordBatch]] = []
    wal.set_batch_listener(groups.append)

    await wal.append(events(7, cores=1, tag="one"))  # one section: LSNs 1..7 as they come
    await wal.append([(2, b"a"), (0, b"b"), (2, b"c"), (1, b"d"), (0, b"e")])
    await asyncio.gather(*(wal.append(events(9, tag=f"g{k}")) for k in range(5)))

    for group in groups:
        assert [b.core for b in group] == sorted({b.core for b in group})
    heard = sorted((r for group in groups for b in group for r in b.records()), key=lambda r: r.lsn)
    assert heard == list(wal.read(1))
    assert [b.lsns.tolist() for b in groups[1]] == [[9, 12], [11], [8, 10]]
    assert [b.first_seq for b in groups[1]] == [8, 1, 1]


async def test_an_append_given_as_core_sections_stores_what_the_same_items_store(
    open_wal: OpenWal, tmp_path: Path
) -> None:
    """Ingest hands its events split by core (CoreSections); the log, the LSNs, the
    sequences and a record listener see them exactly as the (core, payload) items
    in request order, also when several appends share a group commit."""
    items = [((7 * i) % 5, b"p%d" % i * (1 + i % 3)) for i in range(40)]
    plain = open_wal(tmp_path / "plain")
    split = open_wal(tmp_path / "split")
    heard: list[Record] = []
    split.set_listener(heard.extend)

    def as_sections(chunk: list[tuple[int, bytes]]) -> CoreSections:
        payloads = [p for _, p in chunk]
        lens = array("I", map(len, payloads))
        return CoreSections(sections_of([c for c, _ in chunk], payloads, lens), len(chunk))

    chunks = [items[:1], items[1:17], items[17:30], items[30:]]
    for chunk in chunks:
        await plain.append(chunk)
    acks = await asyncio.gather(*(split.append(as_sections(chunk)) for chunk in chunks))

    assert list(split.read(1)) == list(plain.read(1)) == heard
    assert [a[1] - a[0] + 1 for a in acks] == [1, 16, 13, 10]
    assert list(as_sections(items[1:17])) == items[1:17]


def test_core_sections_that_break_their_promise_are_refused_before_anything_is_written(
    open_wal: OpenWal,
) -> None:
    wal = open_wal()
    good = EncodedSection(0, array("I", [0, 1]), array("I", [1, 2]), b"abb")
    bad = [
        CoreSections([good], 3),  # holds 2 events, says 3
        CoreSections([good._replace(blob=b"ab")], 2),  # payload bytes do not add up
        CoreSections([good._replace(deltas=array("I", [0, 2]))], 2),  # position 2 of 2
        CoreSections([good._replace(core=1), good._replace(core=0)], 4),  # cores descend
    ]
    for sections in bad:
        with pytest.raises(ValueError, match="append"):
            wal.append_blocking(sections)
    assert wal.head_lsn() == 0


def _section(core: int, positions: range | list[int]) -> EncodedSection:
    return EncodedSection(
        core, array("I", positions), array("I", [1] * len(positions)), b"x" * len(positions)
    )


@pytest.mark.parametrize("n", [5, 300])  # under and over check_positions' numpy threshold
def test_core_sections_naming_a_position_twice_are_refused_before_anything_is_written(
    open_wal: OpenWal, n: int
) -> None:
    """Two sections, cores ascending, each position in range and ascending, n in
    all: every per-section check passes, but position k - 1 is named by both and
    n - 1 by neither. The append is refused, naming both positions and the cores."""
    wal = open_wal()
    k = n // 2
    sections = CoreSections([_section(0, range(k)), _section(1, range(k - 1, n - 1))], n)

    with pytest.raises(ValueError) as refused:
        wal.append_blocking(sections)

    assert str(refused.value) == (
        f"append(): position {k - 1} of 0 .. {n - 1} is named 2 times (cores 0 and 1)"
        f" and position {n - 1} by no section"
    )
    assert wal.head_lsn() == 0
    wal.append_blocking(CoreSections([_section(0, range(k)), _section(1, range(k, n))], n))
    assert wal.head_lsn() == n


@pytest.mark.parametrize("n", [1, 2, 7, 63, 64, 65, 500])
def test_check_positions_accepts_exactly_the_permutations(n: int) -> None:
    """Random splits of 0 .. n - 1 over cores pass; the same with one position
    moved (to another in range, or past the end) are refused, with the reason."""
    rng = random.Random(n)
    for _ in range(40):
        cores = sorted(rng.sample(range(16), rng.randint(1, min(n, 4))))
        owner = [cores[i] if i < len(cores) else rng.choice(cores) for i in range(n)]
        rng.shuffle(owner)
        split = {c: [i for i in range(n) if owner[i] == c] for c in cores}
        assert check_positions([_section(c, p) for c, p in split.items()], n) is None

        c = rng.choice(cores)
        i = rng.randrange(len(split[c]))
        to = rng.randrange(n + 2)
        moved = {**split, c: sorted([*split[c][:i], to, *split[c][i + 1 :]])}
        why = check_positions([_section(c, p) for c, p in moved.items()], n)
        if to == split[c][i]:
            assert why is None
        elif to >= n:
            assert why == f"core {c}'s section names position {to}, past the last ({n - 1})"
        else:
            assert why is not None
            assert f"position {to} of 0 .. {n - 1} is named 2 times" in why
            assert f"position {split[c][i]} by no section" in why
