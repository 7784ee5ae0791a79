"""The DLQ's copy in the WAL archive (daemon/dlqcopy.py): read beside the
engine, encoded, decoded and written back, every column and id the same."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from daemon import dlqcopy
from triggers.store import TriggerStore


def _rows(rng: random.Random, n: int, start: int = 1) -> list[tuple[Any, ...]]:
    ops = ["insert", "update", "delete"]
    return [
        (
            start + i * rng.randrange(1, 4),  # ids with holes, as after replays and evictions
            rng.choice(["hook", "emit", "ünï"]),
            f"c{rng.randrange(3)}",
            f'k{rng.randrange(1000)}\n"quoted"',
            rng.choice(ops),
            rng.randrange(1, 1 << 40),
            rng.randrange(1, 10),
            rng.choice(["HTTP 500", "timed out after 5.0 s", ""]),
            rng.random() * 2e9,
            rng.random() * 2e9,
            json.dumps({"new": {"n": rng.randrange(10**6)}}),
            rng.choice([None, f"hook:{rng.randrange(100)}"]),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("seed", range(8))
def test_a_copy_written_back_is_the_dlq_it_was_read_from(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    source = TriggerStore(tmp_path / "a" / "queue.sqlite3")
    rows = sorted(_rows(rng, rng.randrange(0, 300)))
    rows = [r for i, r in enumerate(rows) if i == 0 or r[0] != rows[i - 1][0]]
    source.dlq_insert(rows)
    got = dlqcopy.read_dlq(source.path)
    assert got is not None
    mark, read = got
    assert read == rows
    head, decoded = dlqcopy.decode(dlqcopy.encode("w1", 3, read), "dlq/0000000003.jsonl")
    assert (head["wal_id"], head["epoch"], head["entries"]) == ("w1", 3, len(rows))
    target = TriggerStore(tmp_path / "b" / "queue.sqlite3")
    target.dlq_insert([tuple(r[c] for c in dlqcopy._COLUMNS) for r in decoded])
    assert dlqcopy.read_dlq(target.path) == (mark, rows)
    source.close()
    target.close()


def test_the_fingerprint_changes_with_every_insert_and_delete(tmp_path: Path) -> None:
    store = TriggerStore(tmp_path / "queue.sqlite3")
    rng = random.Random(1)
    store.dlq_insert(_rows(rng, 1, start=1) + _rows(rng, 1, start=10))
    first = dlqcopy.read_dlq(store.path)
    assert first is not None
    assert dlqcopy.read_dlq(store.path, since=first[0]) == (first[0], [])  # unchanged: no rows read
    store.dlq_replay(entry_id=1)  # a replay takes row 1 out of the DLQ
    second = dlqcopy.read_dlq(store.path)
    assert second is not None and second[0] != first[0] and [r[0] for r in second[1]] == [10]
    store.close()


def test_a_missing_store_has_no_copy_and_a_cut_copy_is_refused_by_name(tmp_path: Path) -> None:
    assert dlqcopy.read_dlq(tmp_path / "none" / "queue.sqlite3") is None
    body = dlqcopy.encode("w1", 2, _rows(random.Random(2), 5))
    cut = body[: body.rindex(b"\n", 0, len(body) - 1) + 1]  # the last row missing
    with pytest.raises(ValueError, match=r"dlq/x\.jsonl: 4 rows, the header says 5"):
        dlqcopy.decode(cut, "dlq/x.jsonl")
    with pytest.raises(ValueError, match=r"dlq/y\.jsonl: not a DLQ copy"):
        dlqcopy.decode(b"{not json\n", "dlq/y.jsonl")
