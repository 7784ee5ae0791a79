"""History mirrors (``history = true``, SCD type 2; daemon/table/mirror.py) on
real Delta tables, checked against a pure-Python fold of the change log: per
key, every insert or update opens a version (``valid_from_lsn``) that the
key's next event closes (``valid_to_lsn``), a delete closes the current one.

- Generated histories (hypothesis, few keys: many changes of a key in one
  batch, deletes, re-inserts): after every batch the table is the fold, and a
  re-run of the batch changes nothing.
- A real writer process SIGKILLed at each crash point of the commit and at
  random moments, then run again: each version is in the table exactly once.
- The same on S3 (SeaweedFS).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from daemon.table.crash import ENV_CRASH_AT
from daemon.table.errors import CdcLayoutError
from daemon.table.mirror import MirrorTable, bucket_of
from tests.s3.server import S3Server
from tests.table.history_worker import WAL_ID, batches, events, history_mirror
from tests.table.test_mirror import CORES, commit, make_batch, mirror_config

REPO = Path(__file__).resolve().parents[2]
Version = tuple[int | None, bool, str, str]  # valid_to_lsn, is_current, op, doc
# Histories per run; `--soak` runs more.
HISTORIES = {"ci": 4, "soak": 60}


def history_fold(evs: list[tuple[int, str, str, str, Any]]) -> dict[tuple[str, int], Version]:
    """The versions of the ``orders`` collection after ``(lsn, collection, op,
    key, new)`` events, folded one by one in LSN order."""
    import json

    versions: dict[tuple[str, int], list[Any]] = {}
    current: dict[str, tuple[str, int]] = {}
    for lsn, collection, op, key, new in sorted(evs):
        if collection != "orders":
            continue
        held = current.pop(key, None)
        if held is not None:
            versions[held][0], versions[held][1] = lsn, False
        if op != "delete":
            versions[(key, lsn)] = [None, True, op, json.dumps(new)]
            current[key] = (key, lsn)
    return {k: (v[0], v[1], v[2], v[3]) for k, v in versions.items()}


def read_versions(rows: list[dict[str, Any]]) -> dict[tuple[str, int], Version]:
    """The table's rows by (key, valid_from_lsn), each row's own columns checked."""
    out: dict[tuple[str, int], Version] = {}
    for r in rows:
        assert r["lsn"] == r["valid_from_lsn"] and r["updated_at"] == r["valid_from"], r
        assert r["is_current"] is (r["valid_to_lsn"] is None) is (r["valid_to"] is None), r
        assert r["bucket"] == bucket_of(r["key"], 4) and r["amount"] == r["lsn"], r
        out[(r["key"], r["valid_from_lsn"])] = (
            r["valid_to_lsn"],
            r["is_current"],
            r["op"],
            r["doc"],
        )
    assert len(out) == len(rows), "a version is in the table twice"
    current = [k for k, _ in out if out[(k, _)][1]]
    assert len(current) == len(set(current)), "a key has two current versions"
    return out


def table_versions(path: Path | str, **options: Any) -> dict[tuple[str, int], Version]:
    from deltalake import DeltaTable

    return read_versions(DeltaTable(str(path), **options).to_pyarrow_table().to_pylist())


KEYS = st.integers(0, 15).map(lambda i: f"k{i}")
EVENT = st.tuples(
    st.sampled_from(["orders", "orders", "orders", "other"]),
    st.sampled_from(["insert", "update", "delete"]),
    KEYS,
)
HISTORY = st.lists(st.lists(EVENT, min_size=1, max_size=60), min_size=8, max_size=16)


def test_after_every_batch_a_history_mirror_holds_every_version_of_the_fold(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    runs = [0]

    @settings(
        max_examples=HISTORIES["soak" if request.config.getoption("--soak") else "ci"],
        deadline=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(HISTORY)
    def run(history: list[list[tuple[str, str, str]]]) -> None:
        path = tmp_path / f"h{runs[0]}"
        runs[0] += 1
        shutil.rmtree(path, ignore_errors=True)
        m = MirrorTable(history_mirror(path), wal_id=WAL_ID, cores=CORES)
        m.open()
        log: list[tuple[int, str, str, str, Any]] = []
        try:
            for bid, evs in enumerate(history, 1):
                planned = []
                for collection, op, key in evs:
                    lsn = len(log) + len(planned) + 1
                    new = None if op == "delete" else {"amount": lsn}
                    planned.append((lsn, collection, op, key, new))
                log += planned
                batch = make_batch(bid, planned)
                commit(m, batch)
                assert table_versions(path) == history_fold(log)
                # A re-run of the committed batch changes nothing (one that
                # changed nothing, deletes of unknown keys only, commits nothing).
                version = m._table(create=False).version()
                again = commit(m, batch)
                assert again.noop or again.metrics["num_output_rows"] == 0
                assert m._table(create=False).version() == version
        finally:
            m.close()

    run()


def test_history_is_a_mirror_key_and_its_columns_are_the_mirrors_own() -> None:
    from daemon import config as configmod
    from daemon.errors import ConfigError

    entry = {"name": "o", "collection": "orders", "path": "m", "history": True}
    (mirror,) = configmod.parse({"cdc": {"mirrors": [entry]}}).cdc.mirrors
    assert mirror.history is True
    with pytest.raises(ConfigError, match=r"columns.is_current: a mirror's own column"):
        configmod.parse({"cdc": {"mirrors": [{**entry, "columns": {"is_current": "boolean"}}]}})


def test_a_current_state_table_refuses_to_open_as_a_history_mirror(tmp_path: Path) -> None:
    m = MirrorTable(mirror_config(tmp_path / "m"), wal_id=WAL_ID, cores=CORES)
    m.open()
    m.close()
    h = MirrorTable(history_mirror(tmp_path / "m"), wal_id=WAL_ID, cores=CORES)
    with pytest.raises(CdcLayoutError, match=r"valid_from_lsn.*rebuild the mirror"):
        h.open()


# Batches the writer process commits; the named crash points fire at hit
# CRASH_HIT, random kills follow until RANDOM_KILLS.
BATCHES = 30
CRASH_HIT = 4
CRASH_POINTS = ("mirror.before_commit", "mirror.before_merge_commit", "mirror.after_commit")
RANDOM_KILLS = 5


def _run_worker(path: Path, env: dict[str, str], kill_after: float | None) -> tuple[int, str]:
    """The writer process on ``path``; with ``kill_after``, SIGKILLed that many
    seconds after its first commit in this run. Returns (exit code, stderr)."""
    argv = [
        sys.executable,
        "-m",
        "tests.table.history_worker",
        str(path),
        "--batches",
        str(BATCHES),
    ]
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    proc = subprocess.Popen(
        argv, cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        if kill_after is not None:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # its first commit (or a re-run's no-op)
            if line:
                time.sleep(kill_after)
                proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err.decode()


@pytest.mark.crash
@pytest.mark.timeout(600)
def test_sigkill_at_the_history_commit_and_at_random_keeps_each_version_exactly_once(
    tmp_path: Path,
) -> None:
    """1. For each crash point of the mirror's commit, the writer process
       SIGKILLs itself there at its 4th arrival (earlier batches committed).
    2. Then it is SIGKILLed at random moments while it merges (so some kills
       land between a merge's data files and its log entry).
    3. Run once more to the end: the table holds every version of the fold of
       batches 1-30 exactly once, and each batch id is in one Delta commit."""
    from deltalake import DeltaTable

    path = tmp_path / "orders"
    rng = random.Random(45)
    for point in CRASH_POINTS:  # Step 1.
        rc, err = _run_worker(path, {ENV_CRASH_AT: f"{point}@{CRASH_HIT}"}, None)
        assert rc == -signal.SIGKILL and f"crash point {point} reached" in err, (rc, err)
    killed = 0
    for _ in range(RANDOM_KILLS):  # Step 2.
        rc, err = _run_worker(path, {}, rng.uniform(0.0, 0.4))
        killed += rc == -signal.SIGKILL
        assert rc in (0, -signal.SIGKILL), err
    rc, err = _run_worker(path, {}, None)  # Step 3.
    assert rc == 0, err
    want = history_fold([ev for evs in events(BATCHES) for ev in evs])
    assert table_versions(path) == want
    table = DeltaTable(str(path))
    merged = [
        __import__("json").loads(h["userMetadata"])["eventplane"]["batch_id"]
        for h in table.history()
        if h.get("operation") == "MERGE"
    ]
    assert len(merged) == len(set(merged)) and max(merged) == BATCHES, merged
    assert (
        table.transaction_version(
            MirrorTable(history_mirror(path), wal_id=WAL_ID, cores=CORES).app_id
        )
        == BATCHES
    )
    print(
        f"history crash test: {len(CRASH_POINTS)} crash points, {killed} random kills, "
        f"{len(merged)} merges, {len(want)} versions"
    )


@pytest.mark.timeout(300)
def test_a_history_mirror_in_a_bucket_holds_every_version_once(
    tmp_path: Path, s3_server: S3Server
) -> None:
    uri = f"s3://{s3_server.bucket}/h-{uuid.uuid4().hex[:8]}/orders"
    cfg = history_mirror(tmp_path / "state", uri=uri, s3=s3_server.config())
    m = MirrorTable(cfg, wal_id=WAL_ID, cores=CORES)
    m.open()
    try:
        for batch in batches(6):
            commit(m, batch)
        assert commit(m, batches(6)[-1]).noop
    finally:
        m.close()
    got = table_versions(uri, storage_options=s3_server.storage_options())
    assert got == history_fold([ev for evs in events(6) for ev in evs])
