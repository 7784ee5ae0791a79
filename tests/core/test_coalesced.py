"""A coalescing mirror's held batches (daemon/spark/mirrors.py ``Coalesced``):
due when the first is ``merge_interval_ms`` old, or at once when they hold
``merge_max_events`` events of the collection."""

from __future__ import annotations

from types import SimpleNamespace

from daemon.plane.batch import MicroBatch
from daemon.spark.mirrors import Coalesced


def rows(n: int) -> SimpleNamespace:
    return SimpleNamespace(num_rows=n)  # what Coalesced reads of a batch's table


def test_held_batches_are_due_when_the_first_is_the_interval_old() -> None:
    held = Coalesced(10.0, max_events=1000)
    assert held.due_in() is None
    held.add(MicroBatch(1, {}), rows(10))
    assert held.since is not None
    assert 9.0 < (held.due_in(held.since + 0.5) or 0) <= 9.5
    held.add(MicroBatch(2, {}), None)  # a batch without the collection's rows
    assert held.due_in(held.since + 10.0) == 0.0
    assert held.events == 10


def test_held_batches_are_due_at_once_when_they_reach_merge_max_events() -> None:
    held = Coalesced(3600.0, max_events=1000)
    held.add(MicroBatch(1, {}), rows(600))
    assert (held.due_in() or 0) > 3000
    held.add(MicroBatch(2, {}), rows(400))
    assert held.due_in() == 0.0
    tables, batches = held.take()
    assert [b.batch_id for b in batches] == [1, 2] and len(tables) == 2
    assert held.due_in() is None and held.events == 0
