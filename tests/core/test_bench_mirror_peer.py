"""bench_mirror_peer's pure parts: the landing server's numbering, the MERGE's
fold, the sharded changes that make both tables comparable, the comparison, the
open loop's plan and the table (the benchmark itself: `python -m bench.bench_mirror_peer`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.bench_mirror_fresh import change_bodies
from bench.bench_mirror_peer import (
    Change,
    SeqLander,
    SideResult,
    changes,
    compare,
    expected_rows,
    latest_per_key,
    merge,
    open_loop_plan,
    read_rows,
    render,
    row_of,
    stamp,
    verdict,
)


def test_stamp_numbers_every_line_first_with_seq() -> None:
    body = b'{"collection":"orders","op":"update","key":"k1"}\n{"op":"delete","key":"k2"}\n'

    lines = stamp(body, 41).splitlines()

    assert [json.loads(x) for x in lines] == [
        {"seq": 41, "collection": "orders", "op": "update", "key": "k1"},
        {"seq": 42, "op": "delete", "key": "k2"},
    ]
    assert lines[0].startswith(b'{"seq":41,')
    assert json.loads(stamp(b"{}\n", 7)) == {"seq": 7}
    with pytest.raises(ValueError):
        stamp(b"[1]\n", 1)


def test_the_lander_numbers_a_group_from_the_events_before_it(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "l").mkdir()
    lander = SeqLander(tmp_path / "s", tmp_path / "l", 1.0)
    lander.position = 10
    group: Any = [(b'{"k":"a"}\n{"k":"b"}\n', 2, None), (b'{"k":"c"}\n', 1, None)]

    data = lander._data(group)

    assert [json.loads(x)["seq"] for x in data.splitlines()] == [11, 12, 13]
    assert [json.loads(x)["k"] for x in data.splitlines()] == ["a", "b", "c"]
    assert lander.path.parent == tmp_path / "s"  # it appends there, renames into "l"


def test_a_batch_keeps_the_highest_seq_per_key_whatever_its_order() -> None:
    batch = [Change(5, "a", "update", 5), Change(3, "a", "update", 3), Change(4, "b", "insert", 4)]

    assert latest_per_key(batch) == {"a": batch[0], "b": batch[2]}


def test_the_merge_deletes_updates_and_inserts_only_for_a_newer_seq() -> None:
    state = {"a": Change(10, "a", "insert", 1), "b": Change(10, "b", "insert", 1)}
    state["c"] = Change(10, "c", "insert", 1)

    merge(
        state,
        [
            Change(11, "a", "delete"),  # matched, newer: deleted
            Change(9, "b", "delete"),  # matched, older: nothing
            Change(12, "c", "update", 2),  # matched, newer: updated
            Change(13, "d", "delete"),  # not matched, a delete: nothing
            Change(14, "e", "update", 3),  # not matched: inserted (an upsert)
            Change(15, "f", "insert", 4),
            Change(16, "f", "delete"),  # the batch's last change of f wins
        ],
    )

    assert state == {
        "b": Change(10, "b", "insert", 1),
        "c": Change(12, "c", "update", 2),
        "e": Change(14, "e", "update", 3),
    }


def _sequential(bodies: list[bytes]) -> dict[str, Any]:
    """The reference: every event applied one at a time."""
    state: dict[str, Any] = {}
    for body in bodies:
        for line in body.splitlines():
            ev = json.loads(line)
            if ev["op"] == "delete":
                state.pop(ev["key"], None)
            else:
                state[ev["key"]] = row_of(ev["new"])
    return state


def test_the_expected_table_is_every_event_in_order_and_keeps_deletes_out() -> None:
    bodies, _ = change_bodies(200, False, 40, 50, seed=3, next_key=200, shards=4)
    events = changes(bodies, first_seq=1)

    expected = expected_rows(bodies)

    assert expected == _sequential(bodies)
    assert [c.seq for c in events] == list(range(1, 2001))
    last = {c.key: c for c in events}  # each key's last change
    deleted_last = {k for k, c in last.items() if c.op == "delete"}
    assert expected.keys() == {k for k, c in last.items() if c.op != "delete"}
    assert all(expected[k] == row_of(last[k].new) for k in expected)
    assert deleted_last and not deleted_last & expected.keys()


def test_sharded_changes_keep_each_old_key_to_one_client_and_number_from_first_n() -> None:
    bodies, next_key = change_bodies(1000, False, 16, 100, seed=5, next_key=1000, shards=8,
                                     first_n=500)  # fmt: skip
    for j, body in enumerate(bodies):
        for line in body.splitlines():
            ev = json.loads(line)
            k = int(ev["key"][1:])
            if ev["op"] != "insert":
                assert k < 1000 and k % 8 == j % 8
            else:
                assert 1000 <= k < next_key
    ns = [json.loads(x)["new"]["n"] for b in bodies for x in b.splitlines() if b'"new"' in x]
    assert ns[0] >= 500 and ns == sorted(ns) and max(ns) < 500 + 1600


def test_sharded_changes_reach_every_key_of_a_shard() -> None:
    bodies, _ = change_bodies(80, False, 8, 400, seed=9, next_key=80, shards=8)
    touched = {json.loads(x)["key"] for x in bodies[3].splitlines()}

    assert {f"k{i}" for i in range(3, 80, 8)} <= touched


def test_compare_finds_keys_on_one_side_and_rows_that_differ() -> None:
    a = {"k1": row_of({"amount": 1.0, "status": "x"}), "k2": row_of({"amount": 2.0})}
    b = {"k1": row_of('{"status": "x", "amount": 1.0}'), "k3": row_of({"amount": 3.0})}

    assert compare(a, dict(a)).equal
    assert compare(a, dict(a)).describe("A", "B") == "equal: 2 keys, every row the same"
    assert row_of('{"status": "x", "amount": 1.0}') == a["k1"]  # key order is no difference
    c = compare(a, b)
    assert not c.equal
    assert (c.only_left, c.only_right, c.differ) == (["k2"], ["k3"], [])
    b["k1"] = row_of({"amount": 1.5, "status": "x"})
    c = compare(a, b)
    assert c.differ == ["k1"]
    assert "1 keys whose rows differ (k1)" in c.describe("A", "B")
    assert "1 keys only in A (k2)" in c.describe("A", "B")


def test_the_open_loop_plan_sends_every_body_once_and_each_client_its_shard() -> None:
    cases = [(20_000, 20, 8, 200), (20_000, 7.3, 8, 200), (5_000, 3, 3, 100), (1_000, 1, 8, 200)]
    for rate, duration, clients, per_request in cases:
        requests, run_s = open_loop_plan(rate, duration, clients, per_request)
        interval = clients * per_request / rate
        # bench_mirror_fresh.open_loop: client i sends bodies[(k * clients + i) % len]
        # while (i / clients) * interval + k * interval < run_s.
        sent = [
            k * clients + i
            for i in range(clients)
            for k in range(requests)
            if (i / clients) * interval + k * interval < run_s
        ]
        assert sorted(sent) == list(range(requests))
        assert requests % clients == 0
        assert abs(run_s - duration) <= interval


def test_read_rows_gives_a_mirror_table_as_the_fold_does(tmp_path: Path) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    doc = {"amount": 2.5, "status": "update", "n": 7}
    table = pa.table(
        {
            "key": ["k1"],
            "lsn": [3],
            "doc": [json.dumps(doc, separators=(",", ":"))],
            "amount": [2.5],
            "status": ["update"],
        }
    )
    write_deltalake(str(tmp_path / "t"), table)

    assert read_rows(tmp_path / "t") == {"k1": row_of(doc)}


def _result(name: str, rate: float, p99: float) -> SideResult:
    return SideResult(name, events=100_000, seconds=100_000 / rate, cpu_s=2.0, lat_events=400_000,
                      p50_s=p99 / 2, p99_s=p99, lat_cpu_s=8.0, merges=5, lat_merges=20)  # fmt: skip


def test_render_shows_rates_ratios_cpu_and_freshness() -> None:
    table = render([_result("eventplane", 60_000, 1.0), _result("peer", 20_000, 4.0)], 20_000)
    lines = table.splitlines()

    assert lines[0].startswith("| side | events/s | x peer | CPU s | CPU µs/event |")
    assert len(lines) == 4
    ep = [c.strip() for c in lines[2].split("|")[1:-1]]
    peer = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert ep[1:8] == ["60,000", "3.00", "2.0", "20.0", "0.50", "1.00", "0.25"]
    assert peer[1:8] == ["20,000", "1.00", "2.0", "20.0", "2.00", "4.00", "1.00"]
    assert peer[8:] == ["20.0", "5", "20"]
    assert ep[0].startswith("eventplane") and peer[0].startswith("landing files")


def test_verdict_says_whether_each_aim_is_met() -> None:
    met = verdict([_result("eventplane", 30_000, 1.0), _result("peer", 20_000, 3.0)])
    assert met[0].endswith("1.50x (aim >= 1.5x): met")
    assert met[1].endswith("0.33x (aim <= 0.33x): met")

    not_met = verdict([_result("eventplane", 29_000, 1.1), _result("peer", 20_000, 3.0)])
    assert not_met[0].endswith("(aim >= 1.5x): NOT met")
    assert not_met[1].endswith("(aim <= 0.33x): NOT met")
    failed = SideResult("peer", error="boom")
    assert verdict([_result("eventplane", 1, 1), failed]) == [
        "aims: not judged (a side is missing or failed)"
    ]
    assert "failed: boom" in render([failed], 20_000)
    assert SideResult("x").rate == 0.0


def test_the_peer_is_covered_up_to_a_seq_only_once_every_seq_below_it_merged() -> None:
    from bench.bench_mirror_peer import PeerWatcher

    w = PeerWatcher(Path("/nonexistent"), 0.01)

    def commit(first: int, last: int, events: int) -> int:
        meta = {"peer": {"batch": 0, "first": first, "last": last, "events": events}}
        got = w.last_of(json.dumps(meta))
        w.covered = max(w.covered, got)  # as Watcher.run does
        return got

    assert commit(1, 100, 100) == 100
    assert commit(201, 300, 100) == 100  # 101-200 not merged yet
    assert w.gaps == 1
    assert commit(101, 200, 100) == 300
    assert commit(301, 400, 100) == 400


def test_the_plan_gives_each_client_whole_shards_and_numbers_events_across_phases() -> None:
    import argparse

    from bench.bench_mirror_peer import make_plan

    sizes = {"keys": 1003, "events": 10_500, "per_request": 100, "clients": 8}
    args = argparse.Namespace(**sizes, warmup_events=2_000, warmup_parts=3, rate=2_000, duration=2)
    plan = make_plan(args)

    assert plan.keys == 1000  # a whole number of keys per client
    assert sum(b.count(b"\n") for b in plan.preload) == 1000
    assert all(len(part) % 8 == 0 for part in plan.warmup) and len(plan.warmup) == 3
    assert len(plan.run) == 112  # 105 requests, up to a multiple of 8
    assert len(plan.lat) == open_loop_plan(2_000, 2, 8, 200)[0]
    for bodies in [*plan.warmup, plan.run, plan.lat]:
        for j, body in enumerate(bodies):
            olds = [json.loads(x) for x in body.splitlines()]
            assert all(int(e["key"][1:]) % 8 == j % 8 for e in olds if e["op"] != "insert")
    changed = plan.all_bodies()[len(plan.preload) :]
    ns = [json.loads(x)["new"]["n"] for b in changed for x in b.splitlines() if b'"new"' in x]
    assert ns == sorted(ns) and len(set(ns)) == len(ns)
    inserted = [json.loads(x)["key"] for b in plan.all_bodies() for x in b.splitlines()
                if b'"insert"' in x]  # fmt: skip
    assert len(set(inserted)) == len(inserted)  # every insert is of a new key
