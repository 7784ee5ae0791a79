"""bench_mirror_fresh's arithmetic: each request's freshness from the commits
the watcher saw, and the change mix it sends (the benchmark itself: `make bench`)."""

from __future__ import annotations

import json

import pytest

from bench.bench_mirror_fresh import change_bodies, freshness


def test_a_request_is_fresh_at_the_first_commit_that_covers_its_last_lsn() -> None:
    acks = [(10.0, 200), (10.1, 400), (10.2, 600)]
    commits = [(10.5, 200), (11.0, 500), (12.0, 600)]

    assert freshness(acks, commits) == pytest.approx([0.5, 0.9, 1.8])


def test_a_commit_seen_before_the_2xx_came_back_counts_zero() -> None:
    assert freshness([(10.0, 100)], [(9.9, 300)]) == [0.0]


def test_the_changes_are_90_percent_updates_and_hot_keys_take_80_percent() -> None:
    keys = 10_000
    bodies, next_key = change_bodies(keys, True, 100, 200, seed=1, next_key=keys)
    events = [json.loads(line) for b in bodies for line in b.splitlines()]
    ops = [e["op"] for e in events]
    inserts = ops.count("insert")

    assert len(events) == 20_000
    assert 0.88 < ops.count("update") / len(ops) < 0.92
    assert 0.04 < ops.count("delete") / len(ops) < 0.06
    assert next_key == keys + inserts
    assert all(int(e["key"][1:]) >= keys for e in events if e["op"] == "insert")
    assert all("new" not in e for e in events if e["op"] == "delete")
    old = [int(e["key"][1:]) for e in events if e["op"] != "insert"]
    hot = sum(k < keys // 20 for k in old) / len(old)
    assert 0.78 < hot < 0.86  # 80 % hot plus the uniform picks that land there
