"""Three real daemons feeding one lake (docs/scaling.md, docs/cdc.md "Shared tables").

ep-1, ep-2 and ep-3 (``eventplane run``, each its own data_dir, WAL and
``[daemon] name``, embedded Spark ``local[1]``) append to two shared Delta
tables at once: ``lake`` in a SeaweedFS bucket and ``disk`` in one folder,
both compacted as often as they can be (a check every second, two files make
a tier). Keyed producers (``SyncIngestClient(endpoints=[...],
route="key")``: each key always to the same daemon, a down daemon's requests
waiting for it with their ``Idempotency-Key``) post throughout, while:

1. the daemon that maintains ``lake`` is SIGKILLed and left down until
   another daemon takes the maintenance lease, then started again;
2. the new maintainer is SIGKILLed under load and started again at once
   (``--soak``: each other daemon in turn);
3. (``--soak``) more rounds, a random daemon each, at a random moment.

In CI that is five daemon starts (three JVMs on 2 cores): the CI budget of
CONTRIBUTING.md.

Meanwhile a reader polls both tables with delta-rs (and under ``--soak``
Spark reads the disk table after each round): no snapshot holds a (writer, lsn) twice, and none
lacks a row an earlier snapshot held. At the end every acknowledged (writer,
lsn) is in each table once, and nothing else is; the OPTIMIZE commits of
``lake`` name more than one maintainer.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
import urllib.error
from collections import Counter
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import pytest

from daemon.client import SyncIngestClient
from daemon.table import delta
from daemon.table.deltacommit import NAME_KEY
from daemon.table.location import S3Files
from tests import requires
from tests.integration.harness import DaemonProcess, Loader, write_config
from tests.s3.server import S3Server

pytestmark = [pytest.mark.spark, pytest.mark.crash, pytest.mark.timeout(900)]

NAMES = ("ep-1", "ep-2", "ep-3")
SOAK_ROUNDS = 9  # random kills after the three of every run
KEYS = 300
PER_REQUEST = 30
# The S3 leases (each name's writer lease and the maintenance lease): short, so
# that a dead maintainer is replaced within the test.
LEASE_TTL_S, LEASE_SKEW_S = 8.0, 1.0

Row = tuple[str, int]  # (writer, lsn)


def daemon_config(root: Path, name: str, s3: S3Server, uri: str, disk: Path) -> Path:
    shared = 'writers = "shared"\ncompact_min_files = 2\ncompact_interval_s = 1\n'
    extra = f"""
[s3]
endpoint = "{s3.endpoint}"
path_style = true
access_key_id = "{s3.access_key}"
secret_access_key = "{s3.secret_key}"
connect_timeout_s = 1
request_timeout_s = 2
max_retries = 1
lease_ttl_s = {LEASE_TTL_S}
lease_skew_s = {LEASE_SKEW_S}

[spark]
master = "local[1]"
log_level = "ERROR"

[spark.conf]
"spark.sql.shuffle.partitions" = "1"

[[cdc.streams]]
name = "lake"
collections = "*"
path = "{uri}"
{shared}
[[cdc.streams]]
name = "disk"
collections = "*"
path = "{disk}"
{shared}"""
    directory = root / name
    directory.mkdir()
    config = write_config(directory, extra, cores=2, interval_ms=300)
    config.write_text(config.read_text().replace("[daemon]\n", f'[daemon]\nname = "{name}"\n', 1))
    return config


class Producers(Loader):
    """Keyed producers through the client a user would run; every
    acknowledged (writer, lsn), the writer named by the endpoint it went to."""

    def __init__(self, daemons: dict[str, DaemonProcess], producers: int = 2) -> None:
        super().__init__("", producers=producers)
        self.writer = {d.ingest_url + "/v1/events": name for name, d in daemons.items()}
        self.urls = [d.ingest_url for d in daemons.values()]
        self.rows: list[Row] = []
        self.failed: list[str] = []
        self.abandon = threading.Event()  # a failed test: retries end at once

    def _sleep(self, seconds: float) -> None:
        """The client's wait between retries, cut short once the test is abandoned."""
        if self.abandon.wait(seconds):
            raise RuntimeError("the test was abandoned")

    def _produce(self, pid: int) -> None:
        rng = random.Random(pid)
        client = SyncIngestClient(
            endpoints=self.urls,
            route="key",
            timeout_s=10,
            retry_for_s=240,
            max_wait_s=1.0,
            sleep=self._sleep,
        )
        n = 0
        try:
            while not self._halt.is_set():
                events = [
                    {
                        "collection": f"c{rng.randrange(2)}",
                        "op": "update" if (n + i) % 3 else "insert",
                        "key": f"k{rng.randrange(KEYS)}",
                        "new": {"p": pid, "n": n + i},
                    }
                    for i in range(PER_REQUEST)
                ]
                try:
                    ack = client.send(events, key=f"p{pid}-{n}")
                except Exception as exc:  # the client gave up: the test fails on it
                    self.failed.append(f"{type(exc).__name__}: {exc}")
                    return
                rows = [
                    (self.writer[a.endpoint], lsn)
                    for a in ack.acks
                    for lsn in range(a.first_lsn, a.last_lsn + 1)
                ]
                with self._lock:
                    self.rows += rows
                n += PER_REQUEST
                self._halt.wait(0.05)
        finally:
            client.close()

    def count(self) -> int:
        with self._lock:
            return len(self.rows)


def snapshot_rows(uri: str, options: dict[str, str] | None) -> Counter[Row] | None:
    """(writer, lsn) of each row of the table as delta-rs reads it now (None: no table yet)."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        table = DeltaTable(uri, storage_options=options).to_pyarrow_table(columns=["writer", "lsn"])
    except TableNotFoundError:
        return None
    return Counter(zip(table["writer"].to_pylist(), table["lsn"].to_pylist(), strict=True))


class Readers(threading.Thread):
    """delta-rs reading both tables over and over; each snapshot must hold
    every row the one before held, and no row twice. :meth:`check` also
    takes the snapshots of another reader (Spark)."""

    def __init__(self, tables: dict[str, tuple[str, dict[str, str] | None]]) -> None:
        super().__init__(daemon=True)
        self.tables = tables
        self.seen: dict[tuple[str, str], set[Row]] = {}  # (reader, table): its last snapshot
        self.snapshots = Counter[str]()
        self.problems: list[str] = []
        self._halt = threading.Event()
        self._lock = threading.Lock()  # the Spark reads check from the test's thread

    def last(self, name: str, reader: str = "delta-rs") -> set[Row]:
        with self._lock:
            return set(self.seen.get((reader, name), ()))

    def check(
        self, name: str, rows: Counter[Row], reader: str, floor: AbstractSet[Row] = frozenset()
    ) -> None:
        """``rows``, the snapshot ``reader`` read of table ``name``, against its
        previous one and ``floor`` (rows a snapshot read before this one held)."""
        with self._lock:
            twice = [row for row, c in rows.items() if c > 1]
            if twice:
                self.problems.append(f"{reader}: {name} holds {twice[:5]} twice")
            lost = (self.seen.get((reader, name), set()) | floor) - set(rows)
            if lost:
                self.problems.append(
                    f"{reader}: {name} lost {sorted(lost)[:5]} of an earlier snapshot"
                )
            self.seen[(reader, name)] = set(rows)
            self.snapshots[f"{reader} {name}"] += 1

    def run(self) -> None:
        while not self._halt.wait(0.5):
            for name, (uri, options) in self.tables.items():
                try:
                    rows = snapshot_rows(uri, options)
                except Exception as exc:  # a reader that cannot read is a finding too
                    self.problems.append(f"delta-rs: {name}: {type(exc).__name__}: {exc}")
                    continue
                if rows is not None:
                    self.check(name, rows, "delta-rs")

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=60)


def maintainer_of(daemons: dict[str, DaemonProcess], stream: str) -> str | None:
    """The live daemon whose status says it maintains ``stream`` now."""
    for name, d in daemons.items():
        if d.proc is None or d.proc.poll() is not None:
            continue
        try:
            streams = d.status()["spark"].get("streams") or {}
        except (OSError, urllib.error.URLError):
            continue
        if (streams.get(stream, {}).get("maintenance") or {}).get("this_daemon"):
            return name
    return None


def wait_until(what: str, check: Any, timeout_s: float, daemons: dict[str, DaemonProcess]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.5)
    tails = "\n".join(f"--- {n}\n{d.tail(30)}" for n, d in daemons.items())
    raise AssertionError(f"{what}: not within {timeout_s} s\n{tails}")


def start_all(daemons: dict[str, DaemonProcess]) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(daemons)) as pool:
        for f in [pool.submit(d.start, 180.0) for d in daemons.values()]:
            f.result()


def optimizers(files: Any) -> list[str]:
    """The daemon name of each OPTIMIZE commit of a table, in log order."""
    return [
        str(actions["commitInfo"].get(NAME_KEY))
        for _, actions in delta.log_commits(files, -1)
        if actions.get("commitInfo", {}).get("operation") == "OPTIMIZE"
    ]


def test_three_daemons_sigkilled_in_turn_keep_every_acknowledged_row_once_in_both_shared_tables(
    tmp_path: Path, s3_server: S3Server, request: pytest.FixtureRequest
) -> None:
    import uuid

    requires.delta_jars()
    uri = f"s3://{s3_server.bucket}/shared-{uuid.uuid4().hex[:8]}/lake"
    disk = tmp_path / "lake" / "disk"
    daemons = {
        name: DaemonProcess.production(daemon_config(tmp_path, name, s3_server, uri, disk))
        for name in NAMES
    }
    tables = {"lake": (uri, s3_server.storage_options()), "disk": (str(disk), None)}
    readers = Readers(tables)
    rng = random.Random(46)
    timeline: list[str] = []
    t0 = time.monotonic()

    soak = bool(request.config.getoption("--soak"))
    # Spark reads the disk table under --soak only: in CI its JVM's first Delta
    # read beside three daemons took a minute and slowed the suite around it.
    spark = request.getfixturevalue("spark") if soak else None

    def spark_read() -> None:
        if spark is None:
            return
        # A loaded machine can start Spark after the first kill: wait for the table.
        wait_until("the disk table", lambda: readers.last("disk"), 180, daemons)
        # One partition for Delta's log replay (50 by default): a small table's
        # first read then takes seconds, not a minute, beside three daemons.
        spark.conf.set("spark.databricks.delta.snapshotPartitions", "1")
        floor = readers.last("disk")  # read before Spark picks its snapshot
        df = spark.read.format("delta").load(str(disk)).select("writer", "lsn").collect()
        readers.check("disk", Counter((r.writer, r.lsn) for r in df), "spark", floor)
        timeline.append(f"{time.monotonic() - t0:.0f}s Spark read")

    def kill(name: str, restart: bool = True) -> None:
        assert producers is not None
        before = producers.count()
        wait_until("acks before the kill", lambda: producers.count() > before + 300, 120, daemons)
        daemons[name].kill()
        timeline.append(f"{time.monotonic() - t0:.0f}s SIGKILL {name}")
        if restart:
            daemons[name].start(180.0)
            timeline.append(f"{time.monotonic() - t0:.0f}s {name} ready")

    producers: Producers | None = None
    try:
        start_all(daemons)
        producers = Producers(daemons)
        producers.start()
        readers.start()
        # 1. The maintainer of the S3 table dies; another takes its lease.
        first = wait_until(
            "a maintainer of lake", lambda: maintainer_of(daemons, "lake"), 120, daemons
        )
        lake_files = S3Files(uri, s3_server.config())

        def compacted_by(name: str) -> None:
            """Wait for an OPTIMIZE commit of lake by ``name``: it maintained the table."""
            wait_until(
                f"{name} compacts lake", lambda: name in optimizers(lake_files), 120, daemons
            )

        compacted_by(first)
        kill(first, restart=False)
        second = wait_until(
            "the maintenance lease of lake moves",
            lambda: maintainer_of(daemons, "lake"),
            LEASE_TTL_S + LEASE_SKEW_S + 60,
            daemons,
        )
        assert second != first
        timeline.append(f"{time.monotonic() - t0:.0f}s {second} maintains lake")
        daemons[first].start(180.0)
        timeline.append(f"{time.monotonic() - t0:.0f}s {first} ready")
        spark_read()
        # 2. The new maintainer (--soak: each other daemon), under load, started again at once.
        compacted_by(second)
        for name in [n for n in NAMES if n != first] if soak else [second]:
            kill(name)
            spark_read()
        # 3. More of the same, at random, under --soak.
        for _ in range(SOAK_ROUNDS if soak else 0):
            time.sleep(rng.uniform(0, 4))
            kill(rng.choice(NAMES))
        producers.stop()
        assert not producers.is_alive(), "a producer still waits for an acknowledgement"
        timeline.append(f"{time.monotonic() - t0:.0f}s producers stopped")
        assert not producers.failed, producers.failed[:3]
        acked = Counter(producers.rows)
        assert len(acked) > 3000, "the load was too light to prove anything"
        assert max(acked.values()) == 1  # one (writer, lsn) per acknowledged event
        for name, (where, options) in tables.items():
            wait_until(
                f"every acknowledged row in {name}",
                lambda w=where, o=options: set(snapshot_rows(w, o) or ()) >= set(acked),
                180,
                daemons,
            )
        timeline.append(f"{time.monotonic() - t0:.0f}s every row in both tables")
        readers.stop()
        spark_read()
        for name, (where, options) in tables.items():
            assert snapshot_rows(where, options) == acked, name  # nothing else, each once
        assert not readers.problems, readers.problems[:5]
        assert readers.snapshots["delta-rs lake"] > 10 and readers.snapshots["delta-rs disk"] > 10
        assert {first, second} <= set(optimizers(lake_files))
        assert optimizers(disk)
    finally:
        if spark is not None:
            spark.conf.unset("spark.databricks.delta.snapshotPartitions")
        if producers is not None:  # no thread of this test outlives it
            producers.abandon.set()
            producers.stop()
        readers.stop()
        for d in daemons.values():
            d.stop()
    print(
        f"shared daemons: {len(acked)} acknowledged rows, "
        f"{dict(Counter(w for w, _ in acked))} per writer, snapshots {dict(readers.snapshots)}; "
        f"timeline: {timeline}"
    )
