"""A strict mirror's quarantine (daemon/table/mirror.py, docs/cdc.md "Mirror
tables") on real Delta tables on disk: a replay merges what fits now, never
over a newer event of its key (nor a delete), exactly once, also when killed
at each of its steps; a purge removes events for good and records them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon.table import quarantine
from daemon.table.crash import ENV_CRASH_AT, MIRROR_REPLAY_CRASH_POINTS
from daemon.table.layout import META_DIR
from daemon.table.mirror import MirrorTable, superseded_marks
from tests.table.mirror_quarantine_worker import WAL_ID, mirror_config
from tests.table.test_mirror import CORES, commit, make_batch, read_rows

REPO = Path(__file__).resolve().parents[2]


def quarantined_history(path: Path, *, history: bool = False) -> None:
    """Two batches into a strict mirror. Set aside: b@2, c@3, d@4 (batch 1)
    and a@7 (batch 2); batch 2 then updates b (5) and deletes c (6)."""
    m = MirrorTable(mirror_config(path, strict=True, history=history), wal_id=WAL_ID, cores=CORES)
    m.open()
    commit(
        m,
        make_batch(
            1,
            [
                (1, "orders", "insert", "a", {"amount": 1, "n": 1}),
                (2, "orders", "insert", "b", {"n": 2.5}),
                (3, "orders", "insert", "c", {"n": "three"}),
                (4, "orders", "insert", "d", {"n": 4.5}),
            ],
        ),
    )
    m.close()
    m = MirrorTable(mirror_config(path, strict=True, history=history), wal_id=WAL_ID, cores=CORES)
    m.open()
    commit(
        m,
        make_batch(
            2,
            [
                (5, "orders", "update", "b", {"amount": 5, "n": 5}),
                (6, "orders", "delete", "c", None),
                (7, "orders", "update", "a", {"amount": 7, "n": "seven"}),
            ],
        ),
    )
    assert m.quarantined == 4
    m.close()


def opened(path: Path, *, strict: bool = False, history: bool = False) -> MirrorTable:
    m = MirrorTable(mirror_config(path, strict=strict, history=history), wal_id=WAL_ID, cores=CORES)
    m.open()
    return m


def table_version(path: Path) -> int:
    from deltalake import DeltaTable

    return int(DeltaTable(str(path)).version())


def test_a_replay_merges_what_fits_now_and_never_writes_over_a_newer_event_or_a_delete(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m"
    quarantined_history(path)
    assert {k: r["lsn"] for k, r in read_rows(path).items()} == {"a": 1, "b": 5}
    assert superseded_marks(path / META_DIR) == {2: 5, 3: 6}
    m = opened(path)  # no longer strict: n that does not fit is null
    first = m.replay_quarantine({4})
    assert (first["lsns"], first["superseded"], first["quarantined"]) == ([4], [], 3)
    done = m.replay_quarantine()
    assert (done["lsns"], done["superseded"], done["still_refused"]) == ([7], [2, 3], [])
    assert done["quarantined"] == 0 and m.quarantined == 0
    rows = read_rows(path)
    # a: the quarantined update (7) is newer than the table's (1); b keeps its
    # newer update (5) over the quarantined insert (2); c stays deleted.
    assert {k: (r["lsn"], r["amount"], r["n"]) for k, r in rows.items()} == {
        "a": (7, 7.0, None),
        "b": (5, 5.0, 5),
        "d": (4, None, None),
    }
    assert json.loads(rows["a"]["doc"]) == {"amount": 7, "n": "seven"}
    assert rows["d"]["producer"] == "p1" and rows["d"]["updated_at"] is not None
    assert m.cast_failures == {"n": 2}
    version = table_version(path)
    again = m.replay_quarantine()
    assert (again["replayed"], again["superseded"], table_version(path)) == (0, [], version)
    m.close()
    assert quarantine.load(path / META_DIR) == []
    assert not list((path / META_DIR / "quarantine").glob("r*.json"))


def test_a_strict_replay_leaves_the_events_that_still_do_not_fit(tmp_path: Path) -> None:
    path = tmp_path / "m"
    quarantined_history(path)
    version = table_version(path)
    m = opened(path, strict=True)
    done = m.replay_quarantine()
    assert (done["replayed"], done["superseded"]) == (0, [2, 3])
    assert [(r["lsn"], r["error"]) for r in done["still_refused"]] == [
        (4, 'field "new.n": a number does not fit the long column'),
        (7, 'field "new.n": a string does not fit the long column'),
    ]
    assert done["quarantined"] == 2 and table_version(path) == version
    m.close()
    assert [r.lsn for r in quarantine.load(path / META_DIR)] == [4, 7]


def test_a_history_mirror_refuses_to_replay_an_event_a_newer_one_superseded(
    tmp_path: Path,
) -> None:
    from deltalake import DeltaTable

    path = tmp_path / "m"
    quarantined_history(path, history=True)
    m = opened(path, history=True)
    done = m.replay_quarantine()
    assert done["lsns"] == [4, 7] and done["superseded"] == []
    refused = {r["lsn"]: r["error"] for r in done["still_refused"]}
    assert sorted(refused) == [2, 3]
    assert "a newer event (LSN 5)" in refused[2] and "eventplane cdc mirror rebuild" in refused[2]
    m.close()
    versions = sorted(
        (r["key"], r["valid_from_lsn"], r["valid_to_lsn"])
        for r in DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    )
    assert versions == [("a", 1, 7), ("a", 7, None), ("b", 5, None), ("d", 4, None)]
    assert [r.lsn for r in quarantine.load(path / META_DIR)] == [2, 3]


def test_purge_removes_events_for_good_and_records_the_mirror_who_and_what(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m"
    quarantined_history(path)
    m = opened(path, strict=True)
    assert m.purge_quarantine({4, 7}, "ops@host") == 2
    assert m.quarantined == 2
    m.close()
    (entry,) = [
        json.loads(line)
        for line in (path / META_DIR / "quarantine" / quarantine.PURGE_LOG).read_text().splitlines()
    ]
    assert (entry["mirror"], entry["by"], entry["lsns"]) == ("orders", "ops@host", [4, 7])
    assert [r["key"] for r in entry["rows"]] == ["d", "a"]
    assert [r.lsn for r in quarantine.load(path / META_DIR)] == [2, 3]


@pytest.mark.crash
@pytest.mark.parametrize("history", [False, True], ids=["current", "history"])
@pytest.mark.parametrize("point", MIRROR_REPLAY_CRASH_POINTS)
def test_a_replay_killed_at_each_step_lands_exactly_once(
    tmp_path: Path, point: str, history: bool
) -> None:
    """Killed after its intent, the replay rolls back (the events stay
    quarantined); after its merge, forward (they leave). A re-run then
    leaves the table with each replayed event once and one replay commit."""
    from deltalake import DeltaTable

    path = tmp_path / "m"
    quarantined_history(path, history=history)
    argv = [sys.executable, "-m", "tests.table.mirror_quarantine_worker", str(path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), ENV_CRASH_AT: point}
    run = subprocess.run(argv + ["--history"] * history, cwd=REPO, env=env, capture_output=True)
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()
    m = opened(path, history=history)  # recovery
    left = sorted(r.lsn for r in quarantine.load(path / META_DIR))
    assert not list((path / META_DIR / "quarantine").glob("r*.json"))
    if point == "mirror.replay_after_intent":
        assert left == [2, 3, 4, 7]
    else:
        assert left == ([2, 3] if history else [])
    again = m.replay_quarantine()
    m.close()
    assert again["replayed"] == (2 if point == "mirror.replay_after_intent" else 0)
    rows: list[dict[str, Any]] = DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    seen = [(r["key"], r["lsn"]) for r in rows]
    assert len(seen) == len(set(seen))  # no event twice (a history mirror would show it)
    assert {(4, "d"), (7, "a")} <= {(lsn, key) for key, lsn in seen}
    table = DeltaTable(str(path))
    replays = [
        h
        for h in table.history()
        if "replay_id" in json.loads(h.get("userMetadata") or "{}").get("eventplane", {})
    ]
    assert len(replays) == 1
    assert table.transaction_version(m.replay_app_id) == 1


def test_a_rebuilds_set_aside_events_from_the_logs_rows_replay_with_their_time_and_producer(
    tmp_path: Path,
) -> None:
    """A rebuild's batches are the log's rows (no WAL records): the events
    it sets aside are stored again from their columns, and a replay writes
    them as the log has them."""
    from daemon.plane.batch import MicroBatch
    from daemon.spark import frame

    path = tmp_path / "m"
    batch = make_batch(3, [(9, "orders", "insert", "k", {"n": "nine"})])
    m = opened(path, strict=True)
    m.commit(frame.batch_table(batch), MicroBatch(3, {}))  # as mirrorrebuild.rebuild does
    assert m.quarantined == 1
    m.close()
    m = opened(path)
    assert m.replay_quarantine()["lsns"] == [9]
    m.close()
    row = read_rows(path)["k"]
    assert (row["lsn"], row["producer"], row["n"]) == (9, "p1", None)
    assert row["updated_at"].timestamp() == pytest.approx(9e-6)  # ingest_ts_ns 9000


def test_a_quarantine_file_of_the_earlier_layout_is_kept_aside_and_the_mirror_opens(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m"
    folder = path / META_DIR / "quarantine"
    folder.mkdir(parents=True)
    old = {"mirror": "orders", "batch_id": 2, "events": [{"lsn": 3, "key": "a", "op": "insert"}]}
    (folder / "b000000000002.json").write_text(json.dumps(old))
    m = opened(path, strict=True)
    assert m.quarantined == 0
    m.close()
    assert [p.name for p in folder.iterdir()] == ["b000000000002.json.earlier-layout"]


@pytest.mark.parametrize("history", [False, True], ids=["current", "history"])
def test_a_replayed_event_supersedes_the_older_ones_of_its_key_left_in_the_quarantine(
    tmp_path: Path, history: bool
) -> None:
    """a@5 replayed first: a@3, replayed after it, is not written over it (a
    history mirror would have two current versions of ``a``)."""
    from deltalake import DeltaTable

    path = tmp_path / "m"
    m = opened(path, strict=True, history=history)
    commit(m, make_batch(1, [(1, "orders", "insert", "a", {"n": 1})]))
    commit(
        m,
        make_batch(
            2,
            [
                (3, "orders", "update", "a", {"n": "three"}),
                (5, "orders", "update", "a", {"n": "five"}),
            ],
        ),
    )
    m.close()
    m = opened(path, history=history)
    assert m.replay_quarantine({5})["lsns"] == [5]
    later = m.replay_quarantine({3})
    m.close()
    assert later["lsns"] == []
    if history:
        assert [r["lsn"] for r in later["still_refused"]] == [3]
    else:
        assert later["superseded"] == [3]
    rows = DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    current = [r["lsn"] for r in rows if r.get("is_current", True)]
    assert current == [5]


def test_list_names_the_events_a_replay_will_not_write_and_the_newer_event_of_their_key(
    tmp_path: Path,
) -> None:
    import io

    from daemon import config as configmod
    from daemon.cli import cdc as cdccmd
    from daemon.cli.main import build_parser

    path = tmp_path / "m"
    quarantined_history(path)
    entry = {"name": "orders", "collection": "orders", "path": str(path), "strict": True}
    cfg = configmod.parse({"cdc": {"mirrors": [entry]}})

    def cli(*argv: str) -> str:
        out = io.StringIO()
        args = build_parser().parse_args(["cdc", "mirror", "quarantine", *argv])
        assert cdccmd.main(args, cfg, out=out) == 0
        return out.getvalue()

    shown = {r["lsn"]: r["superseded_by"] for r in json.loads(cli("list", "orders", "--json"))}
    assert shown == {2: 5, 3: 6, 4: None, 7: None}
    text = cli("list", "orders")
    assert "mirror 'orders': 4 row(s) in the quarantine" in text
    assert "(superseded by LSN 6)" in text.splitlines()[3]


def test_a_rerun_of_a_batch_whose_events_a_replay_or_a_purge_took_out_does_not_set_them_aside_again(
    tmp_path: Path,
) -> None:
    """A batch that only set events aside leaves no txn: after a crash that
    lost its progress it runs again, and must not bring back what a replay
    wrote (a history mirror would get the version twice) or a purge removed."""
    path = tmp_path / "m"
    m = opened(path, strict=True, history=True)
    batch = make_batch(
        3,
        [(8, "orders", "insert", "x", {"n": "eight"}), (9, "orders", "insert", "y", {"n": 9.5})],
    )
    commit(m, batch)
    assert m.quarantined == 2
    assert m.purge_quarantine({9}, "ops") == 1
    m.close()
    m = opened(path, history=True)
    assert m.replay_quarantine()["lsns"] == [8]
    m.close()
    m = opened(path, strict=True, history=True)
    commit(m, batch)  # the re-run
    assert m.quarantined == 0
    m.close()
    assert [r["lsn"] for r in read_history(path)] == [8]


def read_history(path: Path) -> list[dict[str, Any]]:
    from deltalake import DeltaTable

    return DeltaTable(str(path)).to_pyarrow_table().to_pylist()
