"""No row stops a table: per-stream isolation and the quarantine (docs/cdc.md,
"Quarantine").

Rows whose payload the writer cannot parse are made here by hand (ingest
refuses them, tests/ingest/test_payload_differential.py): invalid UTF-8 in a
value and in a key, a UTF-8-encoded surrogate, nesting deeper than 1,000 and a
number of 1,001 digits."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon.cli import cdc as cdccmd
from daemon.cli.main import build_parser
from daemon.errors import ExecutorError
from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from daemon.table import quarantine, sparkio
from daemon.table.errors import CdcQuarantineLimitError
from daemon.table.layout import META_DIR
from daemon.table.ledger import read_ledger
from daemon.table.parquet import CdcSink
from tests import requires
from tests.spark.support import make_config, read_table
from wal.record import Record

pytestmark = pytest.mark.spark

# Payloads the CDC writers refuse, by what is wrong with them.
BAD_PAYLOADS = {
    "invalid UTF-8 in a value": b'{"a":"\xff\xfe"}',
    "invalid UTF-8 in a key": b'{"\xff":1}',
    "an encoded surrogate": b'{"a":"\xed\xa0\x80"}',
    "nesting deeper than 1000": b'{"a":' * 1001 + b"1" + b"}" * 1001,
    "a number of 1001 digits": b'{"a":' + b"9" * 1001 + b"}",
}


def events(collections: list[str], bad: dict[int, bytes]) -> list[Record]:
    """One insert per collection in turn, LSN 1 up; ``bad`` maps LSNs to their payloads."""
    out = []
    for i, lsn in enumerate(range(1, len(collections) + 1)):
        new = bad.get(lsn, b'{"n":%d}' % lsn)
        ev = StoredEvent(collections[i], "insert", f"k{lsn}", new, None, 1_700_000_000 * 10**9)
        out.append(Record(lsn, 0, lsn, encode(ev)))
    return out


def batch_of(records: list[Record], batch_id: int = 1) -> MicroBatch:
    return MicroBatch(batch_id, {0: Slice(0, records[0].lsn, records[-1].lsn, records)})


@pytest.fixture(params=[True, False], ids=["direct", "spark-job"])
def direct_write(request: Any, spark: Any) -> bool:
    reason = sparkio.direct_write_missing(spark)
    requires.daemon_jar(reason)  # `make test` builds it
    return bool(request.param)


@pytest.fixture
async def make(
    spark: Any, tmp_path: Path, metrics: Metrics, direct_write: bool
) -> AsyncIterator[Callable[..., Any]]:
    """``await make(**config)`` -> a started executor on the shared session,
    writing batches without a Spark job or with one (``direct_write``)."""
    made: list[SparkExecutor] = []

    async def build(**config: Any) -> SparkExecutor:
        cfg = make_config(tmp_path, **config)
        cfg = replace(cfg, spark=replace(cfg.spark, direct_write=direct_write))
        ex = SparkExecutor(cfg, metrics, wal_id="wal-1", session=spark)
        await ex.start()
        made.append(ex)
        return ex

    yield build
    for ex in made:
        await ex.stop()


async def test_a_bad_row_of_one_collection_fails_only_the_stream_that_takes_it(
    spark: Any, make: Any, tmp_path: Path
) -> None:
    """Eight streams, one per collection; with the quarantine off, the bad row
    in c1 fails stream c1 alone, with the JVM's own error and the row's LSN;
    the seven others commit their rows."""
    names = [f"c{i}" for i in range(8)]
    streams = [(n, (n,)) for n in names]
    ex = await make(streams=streams, stream_options={"quarantine_max_rows": 0})
    records = events(names * 3, {10: BAD_PAYLOADS["invalid UTF-8 in a value"]})  # LSN 10: c1

    failures = await ex.execute(batch_of(records))

    assert set(failures) == {"cdc:c1"}
    text = ex.status()["last_error"]
    assert "stage cdc:c1" in text and "(lsn 10)" in text
    assert "JsonParseException: Invalid UTF-8 start byte 0xff" in text
    for n in names:
        if n == "c1":
            continue
        rows = read_table(spark, tmp_path / "cdc" / n)
        assert sorted(r.lsn for r in rows) == [
            r.lsn for r in records if names[(r.lsn - 1) % 8] == n
        ]


@pytest.mark.parametrize("kind", sorted(BAD_PAYLOADS))
async def test_rows_that_fail_alone_go_to_the_quarantine_and_the_rest_commits(
    spark: Any, make: Any, tmp_path: Path, kind: str
) -> None:
    """1. A batch of 40 rows of two collections, two of them bad (LSNs 7 and
       30), one stream of every collection.
    2. It commits: the table holds the 38 others, the quarantine the two, with
       the event as stored and the writer's error; the ledger counts them.
    3. The same batch again (a re-run after a crash) changes nothing."""
    ex = await make()
    bad = {7: BAD_PAYLOADS[kind], 30: BAD_PAYLOADS[kind]}
    records = events(["a", "b"] * 20, bad)

    failures = await ex.execute(batch_of(records))

    assert not failures
    table = tmp_path / "cdc" / "all"
    rows = read_table(spark, table)
    assert sorted(r.lsn for r in rows) == [r.lsn for r in records if r.lsn not in bad]
    held = quarantine.load(table / META_DIR)
    assert [r.lsn for r in held] == [7, 30]
    assert [r.payload for r in held] == [bytes(records[6].payload), bytes(records[29].payload)]
    assert all(r.error.startswith(("new: ", "old: ")) for r in held), held[0].error
    entry = read_ledger(table)
    assert entry is not None and entry.batches[-1].quarantined == 2
    assert entry.batches[-1].rows == 38
    assert ex.status()["streams"]["all"]["quarantined"] == 2

    again = await ex.execute(batch_of(records))

    assert not again
    assert len(read_table(spark, table)) == 38
    assert [r.lsn for r in quarantine.load(table / META_DIR)] == [7, 30]


async def test_a_failure_of_every_write_is_retried_and_nothing_is_set_aside(
    make: Any, tmp_path: Path
) -> None:
    """A write that fails whatever the rows (a full disk) fails the batch: no
    row of it fails alone, so none is quarantined, and the retry commits all."""
    ex = await make()
    records = events(["a", "b"] * 5, {})
    full = OSError(28, "No space left on device")
    with (
        mock.patch.object(CdcSink, "_write_staged", side_effect=full),
        pytest.raises(ExecutorError, match="No space left on device"),
    ):
        await ex.execute(batch_of(records))
    table = tmp_path / "cdc" / "all"
    assert quarantine.load(table / META_DIR) == []

    assert not await ex.execute(batch_of(records))
    entry = read_ledger(table)
    assert entry is not None and entry.batches[-1].rows == 10


async def test_more_rows_failing_alone_than_the_limit_fail_the_batch_and_set_nothing_aside(
    make: Any, tmp_path: Path
) -> None:
    """Past quarantine_max_rows the writer, not the rows, is broken: the batch
    fails with an error that says so, and nothing goes to the quarantine."""
    ex = await make(stream_options={"quarantine_max_rows": 2})
    bad = {lsn: BAD_PAYLOADS["invalid UTF-8 in a value"] for lsn in (2, 4, 6)}
    records = events(["a"] * 8, bad)

    with pytest.raises((ExecutorError, CdcQuarantineLimitError), match="quarantine_max_rows"):
        await ex.execute(batch_of(records))

    table = tmp_path / "cdc" / "all"
    assert quarantine.load(table / META_DIR) == []
    entry = read_ledger(table)
    assert entry is not None and entry.last_batch_id == 0


def test_a_quarantine_file_of_a_batch_that_never_committed_is_removed_at_open(
    tmp_path: Path,
) -> None:
    """Written before the intent: above the ledger's last batch and without an
    intent, it is from an attempt that never committed (the batch re-runs)."""
    meta = tmp_path / META_DIR
    row = quarantine.QuarantinedRow(5, 0, 5, 3, "a", "insert", "k", "boom", b"\x98", 1.0)
    quarantine.write_batch(meta, "s", 3, [row])
    quarantine.write_batch(meta, "s", 2, [row])

    removed = quarantine.recover(meta, last_batch_id=2, intents=set())

    assert removed == [3]
    assert json.loads(quarantine.batch_file(meta, 2).read_text())["batch_id"] == 2
    assert not quarantine.batch_file(meta, 3).exists()


@pytest.fixture
def strict_duplicate_keys(spark: Any) -> Iterator[Callable[[bool], None]]:
    """``strict(True)`` makes the writer refuse duplicate keys (a writer limit
    ingest does not know), ``strict(False)`` fixes that cause again."""
    key = "spark.sql.variant.allowDuplicateKeys"
    before = spark.conf.get(key)

    def strict(on: bool) -> None:
        spark.conf.set(key, "false" if on else "true")

    yield strict
    spark.conf.set(key, before)


DUPLICATE = b'{"a":1,"a":2}'


async def test_replay_writes_quarantined_rows_into_the_table_exactly_once_after_the_fix(
    spark: Any, make: Any, tmp_path: Path, strict_duplicate_keys: Callable[[bool], None]
) -> None:
    """1. The writer refuses duplicate keys: three rows are set aside, one of
       them (LSN 9) with invalid UTF-8.
    2. Replay while the cause is not fixed: nothing moves.
    3. The cause fixed, replay: the two duplicate-key rows are in the table,
       once; LSN 9 stays, with the writer's reason.
    4. Replay again: nothing more is written."""
    ex = await make()
    table = tmp_path / "cdc" / "all"
    bad = {3: DUPLICATE, 6: DUPLICATE, 9: BAD_PAYLOADS["invalid UTF-8 in a value"]}
    records = events(["a", "b"] * 6, bad)
    strict_duplicate_keys(True)
    assert not await ex.execute(batch_of(records))
    assert [r.lsn for r in quarantine.load(table / META_DIR)] == [3, 6, 9]

    unchanged = await ex.quarantine_action("all", "replay", None)
    assert unchanged["replayed"] == 0 and unchanged["quarantined"] == 3

    strict_duplicate_keys(False)
    done = await ex.quarantine_action("all", "replay", None)

    assert done["lsns"] == [3, 6] and done["quarantined"] == 1
    assert [r["lsn"] for r in done["still_refused"]] == [9]
    lsns = sorted(r.lsn for r in read_table(spark, table))
    assert lsns == [lsn for lsn in range(1, 13) if lsn != 9]
    row = spark.read.parquet(str(table)).where("lsn = 3").select("new_json", "batch_id").first()
    assert row.new_json == DUPLICATE.decode() and row.batch_id == 1
    assert [r.lsn for r in quarantine.load(table / META_DIR)] == [9]
    assert ex.status()["streams"]["all"]["quarantined"] == 1

    again = await ex.quarantine_action("all", "replay", None)
    assert again["replayed"] == 0
    assert len(read_table(spark, table)) == 11


async def test_purge_removes_rows_for_good_and_records_who_when_and_what(
    make: Any, tmp_path: Path
) -> None:
    ex = await make()
    table = tmp_path / "cdc" / "all"
    bad = {2: BAD_PAYLOADS["an encoded surrogate"], 4: BAD_PAYLOADS["an encoded surrogate"]}
    assert not await ex.execute(batch_of(events(["a"] * 5, bad)))

    result = await ex.quarantine_action("all", "purge", {2}, "ops@example (ticket 7)")

    assert result == {"stream": "all", "purged": 1, "quarantined": 1}
    assert [r.lsn for r in quarantine.load(table / META_DIR)] == [4]
    log = (table / META_DIR / "quarantine" / quarantine.PURGE_LOG).read_text().splitlines()
    entry = json.loads(log[-1])
    assert entry["by"] == "ops@example (ticket 7)" and entry["lsns"] == [2]
    assert entry["rows"][0]["error"].startswith("new: JsonParseException")
    assert entry["at"] > 0


async def test_the_cli_lists_replays_and_purges_while_no_daemon_holds_the_stream(
    spark: Any, make: Any, tmp_path: Path, strict_duplicate_keys: Callable[[bool], None]
) -> None:
    """``eventplane cdc quarantine``: ``list --json`` gives lsn, collection,
    key and error per row; with the daemon stopped, ``replay`` and ``purge
    --yes`` take the stream's lock and work here."""
    ex = await make()
    bad = {1: DUPLICATE, 2: BAD_PAYLOADS["invalid UTF-8 in a key"]}
    strict_duplicate_keys(True)
    assert not await ex.execute(batch_of(events(["a", "b", "a"], bad)))
    await ex.stop()
    cfg = make_config(tmp_path)

    def cli(*argv: str) -> tuple[int, str]:
        out = io.StringIO()
        args = build_parser().parse_args(["cdc", "quarantine", *argv])
        return cdccmd.main(args, cfg, session=spark, out=out), out.getvalue()

    code, text = cli("list", "all", "--json")
    rows = json.loads(text)
    assert code == 0 and [(r["lsn"], r["collection"], r["key"]) for r in rows] == [
        (1, "a", "k1"),
        (2, "b", "k2"),
    ]
    assert "VARIANT_DUPLICATE_KEY" in rows[0]["error"] and rows[1]["new"] == '{"\\xff":1}'

    strict_duplicate_keys(False)
    code, text = cli("replay", "all")
    assert code == 0 and "replayed 1 row(s)" in text and "still refused: LSN 2" in text

    code, text = cli("purge", "all")
    assert code == 2  # neither --lsn nor --all
    code, text = cli("purge", "all", "--all", "--yes")
    assert code == 0 and "purged 1 row(s)" in text
    code, text = cli("list", "all")
    assert "the quarantine is empty" in text
    assert sorted(r.lsn for r in read_table(spark, tmp_path / "cdc" / "all")) == [1, 3]
