"""Coalesced mirror merges (``merge_interval_ms``, docs/cdc.md, "Coalesced
merges"): the real planner, plan log and mirror executor on real Delta tables
(delta-rs), the WAL a list of records the planner re-reads from.

- N > 0: fewer Delta commits than batches; each commit's txn is the last batch
  it merged, the commits cover every batch once, in order; the mirror is the
  Python fold of the events (history: every version).
- A held batch is not progress: the stage's progress, the watermarks (which
  WAL retention and the plan log follow) stay below it until its merge
  commits; a clean stop merges what is held.
- A merge that fails sends the stage back to its progress: it re-runs the
  held batches from their plans, and the mirror is still the fold.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from daemon import events
from daemon.config import CdcConfig, CdcMirror, Config, DaemonConfig, HealthConfig, MicrobatchConfig
from daemon.plane.planlog import PlanLog
from daemon.plane.planner import Planner
from daemon.plane.watermarks import Watermarks, WatermarkSnapshot
from daemon.service.metrics import Metrics
from daemon.shard import core_of
from daemon.spark.mirrors import MirrorExecutor
from tests.table.test_mirror import COLUMNS, read_rows
from tests.table.test_mirror_history import history_fold, table_versions
from wal.record import Record

CORES = 2
STAGE = "mirror:orders"


class Plane:
    """A planner over a list-of-records WAL, driving a mirrors-only executor."""

    def __init__(self, root: Path, mirror: CdcMirror) -> None:
        self.root = root
        self.mirror = mirror
        self.metrics = Metrics()
        cfg = Config(
            daemon=DaemonConfig(data_dir=root / "var", cores=CORES),
            health=HealthConfig(attempt_slow_s=600.0),
            cdc=CdcConfig(mirrors=(mirror,)),
        )
        self.executor = MirrorExecutor(cfg, self.metrics, wal_id="wal-t")
        self.wal: list[Record] = []
        self.events: list[tuple[int, str, str, str, Any]] = []
        self.lsn = 0
        self.planner: Planner | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> Planner:
        await self.executor.start()
        # Its warm-up (pyarrow's kernels, seconds on a busy machine) over first.
        await asyncio.get_running_loop().run_in_executor(self.executor._pool, lambda: None)
        plan_log = PlanLog(self.root / "plans.log", "wal-t", CORES)
        wm = Watermarks(WatermarkSnapshot("wal-t", CORES, 0, (0,) * CORES), self.metrics)
        wal = self.wal

        async def load_slice(core: int, first: int, last: int) -> list[list[Record]]:
            return [[r for r in wal if r.core == core and first <= r.lsn <= last]]

        self.planner = Planner(
            cores=CORES,
            cfg=MicrobatchConfig(interval_ms=20, retry_initial_ms=1, retry_max_ms=20),
            pending_max_bytes=1 << 24,
            executor=self.executor,
            plan_log=plan_log,
            watermarks=wm,
            metrics=self.metrics,
            plans=plan_log.open(),
            load_slice=load_slice,
        )
        self.task = asyncio.create_task(self.planner.run())
        return self.planner

    def send(self, evs: list[tuple[str, str]]) -> None:
        """``(op, key)`` events of ``orders``; ``new`` is ``{"amount": lsn, ...}``."""
        assert self.planner is not None
        per: dict[int, list[Record]] = {}
        for op, key in evs:
            self.lsn += 1
            lsn = self.lsn
            new = None if op == "delete" else {"amount": lsn, "status": op, "n": lsn}
            self.events.append((lsn, "orders", op, key, new))
            body = None if new is None else json.dumps(new).encode()
            stored = events.StoredEvent("orders", op, key, body, None, lsn * 1000, producer="p1")  # type: ignore[arg-type]
            core = core_of("orders", key, CORES)
            per.setdefault(core, []).append(Record(lsn, core, lsn, events.encode(stored)))
        for core, records in sorted(per.items()):
            self.wal.extend(records)
            self.planner.add(core, records)

    async def settle(self) -> None:
        """Until every event sent is in a batch whose live run is over."""
        planner = self.planner
        assert planner is not None
        for _ in range(3000):
            pending = sum(planner.pending_rows(c) for c in range(CORES))
            if not pending and planner.live_id == planner._next_id - 1:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the planner did not take every event")

    async def stop(self) -> None:
        """A clean stop once every event is in a batch: the planner's run ends,
        then the executor stops."""
        assert self.planner is not None and self.task is not None
        await self.settle()
        self.planner.request_stop()
        await asyncio.wait_for(self.task, 60)
        await self.executor.stop()
        await self.planner.aclose()


def waves(n: int, keys: int = 12) -> list[list[tuple[str, str]]]:
    """Inserts, updates, deletes and re-inserts of a few keys, over ``n`` waves."""
    out = []
    for w in range(n):
        wave = []
        for k in range(keys):
            step = (w + k) % 4
            op = ("insert", "update", "delete", "insert")[step]
            if (w * keys + k) % 3 != 2:
                wave.append((op, f"k{k}"))
        out.append(wave)
    return out


def fold(evs: list[tuple[int, str, str, str, Any]]) -> dict[str, int]:
    """key -> LSN of its last event, unless that is a delete."""
    state: dict[str, int] = {}
    for lsn, _, op, key, _ in sorted(evs):
        if op == "delete":
            state.pop(key, None)
        else:
            state[key] = lsn
    return state


def mirror_commits(path: Path) -> list[tuple[int, int]]:
    """(first batch, txn version) of each of the table's merges, in log order."""
    out = []
    for entry in sorted((path / "_delta_log").glob("*.json")):
        txn = meta = None
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            txn = action["txn"]["version"] if "txn" in action else txn
            info = action.get("commitInfo", {})
            if "userMetadata" in info:
                meta = json.loads(info["userMetadata"])["eventplane"]
        if txn is not None:
            assert meta is not None and meta["batch_id"] == txn, (entry, meta)
            first = meta.get("coalesced", [txn, txn])[0]
            assert meta.get("coalesced", [txn, txn])[1] == txn
            out.append((first, txn))
    return out


def mirror(
    tmp_path: Path, interval_ms: int, history: bool = False, max_events: int = 1_000_000
) -> CdcMirror:
    return CdcMirror(
        "orders",
        "orders",
        tmp_path / "mirror",
        COLUMNS,
        buckets=4,
        history=history,
        merge_interval_ms=interval_ms,
        merge_max_events=max_events,
    )


@pytest.mark.parametrize("history", [False, True], ids=["current", "history"])
async def test_coalescing_merges_fewer_commits_than_batches_each_txn_its_last_batch_and_the_fold(
    tmp_path: Path, history: bool
) -> None:
    # A batch per wave (8 events); a group merges once it holds 20 events, so
    # every third batch, however slow the machine (the interval never passes).
    plane = Plane(tmp_path, mirror(tmp_path, 600_000, history, max_events=20))
    planner = await plane.start()
    for wave in waves(16):
        plane.send(wave)
        await plane.settle()
    await plane.stop()

    batches = planner.live_id
    commits = mirror_commits(tmp_path / "mirror")
    assert batches >= 10
    assert 1 < len(commits) < batches / 2, (commits, batches)
    # Every batch in exactly one commit, in order; each txn is its last batch.
    assert commits[0][0] == 1 and commits[-1][1] == batches
    assert all(nxt[0] == prev[1] + 1 for prev, nxt in itertools.pairwise(commits))
    assert planner.watermarks.stages[STAGE] == batches == planner.watermarks.batch_id
    if history:
        assert table_versions(tmp_path / "mirror") == history_fold(plane.events)
    else:
        rows = read_rows(tmp_path / "mirror")
        assert {k: r["lsn"] for k, r in rows.items()} == fold(plane.events)
        assert all(r["amount"] == r["lsn"] and r["op"] != "delete" for r in rows.values())


async def test_with_merge_interval_ms_0_every_batch_is_its_own_commit(tmp_path: Path) -> None:
    """The default, for comparison: one merge per batch that has rows."""
    plane = Plane(tmp_path, mirror(tmp_path, 0))
    planner = await plane.start()
    for wave in waves(5):
        plane.send(wave)
        await asyncio.sleep(0.06)
    await plane.stop()
    commits = mirror_commits(tmp_path / "mirror")
    assert [t for _, t in commits] == list(range(1, planner.live_id + 1))


async def test_held_batches_are_not_progress_until_merged_and_a_clean_stop_merges_them(
    tmp_path: Path,
) -> None:
    plane = Plane(tmp_path, mirror(tmp_path, 600_000))
    planner = await plane.start()
    for wave in waves(4):
        plane.send(wave)
        await asyncio.sleep(0.08)
    assert planner.live_id >= 3
    # Taken (the stage runs each live batch) but none committed: the stage's
    # progress, and with it the watermarks, WAL retention and the plan log, stay.
    assert planner.stages.position(STAGE) == planner.live_id
    assert planner.stages.progress(STAGE) == 0 == planner.watermarks.batch_id
    assert planner.stages.entry(STAGE, planner.live_id)["held_batches"] == planner.live_id
    assert planner.stages.floor() == 0  # what the watermarks may move to
    assert mirror_commits(tmp_path / "mirror") == []
    status = plane.executor.status()["mirrors"]["orders"]
    assert status["held_batches"] == planner.live_id and status["merge_interval_ms"] == 600_000

    await plane.stop()
    # The clean stop merged them in one commit, and recorded it.
    assert mirror_commits(tmp_path / "mirror") == [(1, planner.live_id)]
    assert planner.watermarks.stages[STAGE] == planner.live_id == planner.watermarks.batch_id
    assert {k: r["lsn"] for k, r in read_rows(tmp_path / "mirror").items()} == fold(plane.events)


async def test_a_failed_coalesced_merge_re_runs_its_batches_from_the_plans_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plane = Plane(tmp_path, mirror(tmp_path, 200))
    planner = await plane.start()
    table = plane.executor._mirrors[0]
    real = table.commit_many
    failed: list[tuple[int, int]] = []

    def fail_once(tables: list[Any], batches: list[Any]) -> Any:
        if not failed:
            failed.append((batches[0].batch_id, batches[-1].batch_id))
            raise OSError("the store said no")
        return real(tables, batches)

    monkeypatch.setattr(table, "commit_many", fail_once)
    for wave in waves(10):
        plane.send(wave)
        await asyncio.sleep(0.06)
    await plane.stop()

    assert failed and failed[0][0] == 1
    commits = mirror_commits(tmp_path / "mirror")
    assert commits[0][0] == 1 and commits[-1][1] == planner.live_id
    assert all(nxt[0] == prev[1] + 1 for prev, nxt in itertools.pairwise(commits))
    assert {k: r["lsn"] for k, r in read_rows(tmp_path / "mirror").items()} == fold(plane.events)
    assert planner.watermarks.stages[STAGE] == planner.live_id


def test_a_batch_without_the_collections_rows_joins_the_held_ones_instead_of_passing_them(
    tmp_path: Path,
) -> None:
    """The Spark executor's path (``counts`` known): a batch with no rows of
    the mirror's collection is done at once when nothing is held, but held
    when batches are, so the stage's progress never passes a held batch."""
    from daemon.plane.batch import Held
    from daemon.spark.lanes import Lanes
    from daemon.spark.mirrors import coalescers, commit_mirrors
    from daemon.table.mirror import MirrorTable
    from tests.table.test_mirror import make_batch

    table = MirrorTable(mirror(tmp_path, 600_000), wal_id="wal-t", cores=CORES)
    table.open()
    co = coalescers([table])
    lanes = Lanes()

    def run(bid: int, evs: list[Any]) -> dict[str, BaseException]:
        failures: dict[str, BaseException] = {}
        held: dict[str, Held] = {}
        counts = {"orders": sum(1 for e in evs if e[1] == "orders")}
        commit_mirrors(
            [table],
            make_batch(bid, evs),
            {STAGE},
            counts,
            lanes=lanes,
            wait_s=float("inf"),
            failures=failures,
            in_flight={},
            metrics=Metrics(),
            landed_failure=lambda exc, stage: None,
            coalesced=co,
            held=held,
        )
        return {**failures, **held}

    try:
        assert run(1, [(1, "other", "insert", "x", {"amount": 1})]) == {}  # done: none held
        assert isinstance(run(2, [(2, "orders", "insert", "a", {"amount": 2})])[STAGE], Held)
        assert isinstance(run(3, [(3, "other", "insert", "y", {"amount": 3})])[STAGE], Held)
        assert [b.batch_id for b in co[STAGE].batches] == [2, 3]
        tables, batches = co[STAGE].take()
        table.commit_many(tables, batches)
        assert mirror_commits(tmp_path / "mirror") == [(2, 3)]
        assert set(read_rows(tmp_path / "mirror")) == {"a"}
    finally:
        lanes.close()
        table.close()
