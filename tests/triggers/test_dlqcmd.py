"""``eventplane dlq list|replay|purge`` through the real CLI, on a store the
engine filled (a real receiver answering 4xx)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from daemon.cli.main import main as cli
from daemon.config import load
from tests.triggers.support import FakeClock, Receiver, Reply, batch, event, hand_evaluation

CONFIG = """
[daemon]
data_dir = "data"

[[triggers]]
name = "hook"
collection = "orders"
batch_size = 2
action = {{ type = "webhook", url = "{url}" }}

[[triggers]]
name = "other"
collection = "users"
action = {{ type = "webhook", url = "{url}" }}
"""


# "hook" alone, with the default batch_size (1024).
ONE_HOOK = """
[daemon]
data_dir = "data"

[[triggers]]
name = "hook"
collection = "orders"
action = {{ type = "webhook", url = "{url}" }}
"""


@pytest.fixture
def config(tmp_path: Path, receiver: Receiver) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(CONFIG.format(url=receiver.url))
    return path


async def dead_letter(
    make_engine: Any, config: Path, receiver: Receiver, events: dict[str, list[int]]
) -> Any:
    receiver.default = Reply(422, body="unprocessable")
    cfg = load(config)
    engine = await make_engine(cfg.triggers, data_dir=cfg.data_dir)
    matched = {
        name: [event(lsn, collection="orders" if name == "hook" else "users", key=f"k{lsn}")
               for lsn in lsns]
        for name, lsns in events.items()
    }  # fmt: skip
    await engine.finish(batch(), hand_evaluation(engine, matched))
    receiver.default = Reply(200)
    receiver.requests.clear()
    return engine


async def test_dlq_list_prints_a_readable_table(
    make_engine: Any, config: Path, receiver: Receiver, capsys: Any
) -> None:
    await dead_letter(make_engine, config, receiver, {"hook": [3, 4, 5], "other": [9]})
    capsys.readouterr()  # drop the engine's log lines

    assert cli(["dlq", "list", "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "ID", "TRIGGER", "COLLECTION", "KEY", "OP", "LSN", "ATTEMPTS", "FIRST", "ATTEMPT",
        "LAST", "ATTEMPT", "LAST", "ERROR",
    ]  # fmt: skip
    assert lines[1].split()[:7] == ["1", "hook", "orders", "k3", "insert", "3", "1"]
    assert lines[1].split()[7:9] == ["2023-11-14T22:13:20Z", "2023-11-14T22:13:20Z"]
    assert lines[1].endswith(f"HTTP 422 from {receiver.url}: unprocessable")
    assert len(lines) == 1 + 4 + 2
    assert lines[-1] == "4 of 4 entries shown, oldest first."

    assert cli(["dlq", "list", "--trigger", "other", "--limit", "5", "--config", str(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[1] for ln in out[1:2]] == ["other"]
    assert out[-1] == '1 of 1 entries of trigger "other" shown, oldest first.'


async def test_dlq_replay_by_trigger_delivers_the_rows_again(
    make_engine: Any, config: Path, receiver: Receiver, clock: FakeClock, capsys: Any
) -> None:
    """1. A 422 dead-letters three rows of "hook" and one of "other".
    2. `dlq replay --trigger hook` moves hook's rows to the retry queue, regrouped
       by the trigger's batch_size (2), due now.
    3. The next retry pass delivers them with their original idempotency keys."""
    engine = await dead_letter(make_engine, config, receiver, {"hook": [3, 4, 5], "other": [9]})
    capsys.readouterr()  # drop the engine's log lines

    assert cli(["dlq", "replay", "--trigger", "hook", "--config", str(config)]) == 0
    assert 'Moved 3 entries of trigger "hook" back to the retry queue' in capsys.readouterr().out
    assert await engine.deliver_due() == 2

    assert [r.lsns for r in receiver.requests] == [[3, 4], [5]]
    assert [r.headers["Idempotency-Key"] for r in receiver.requests] == ["hook:3-4", "hook:5-5"]
    assert receiver.requests[0].body["rows"][0]["idempotency_key"] == "hook:3"
    assert [e.trigger for e in engine._store.dlq_list()] == ["other"]
    assert engine._store.pending() == []


async def test_dlq_replay_by_id_moves_one_entry(
    make_engine: Any, config: Path, receiver: Receiver, capsys: Any
) -> None:
    engine = await dead_letter(make_engine, config, receiver, {"hook": [3, 4]})
    capsys.readouterr()  # drop the engine's log lines
    [_, second] = engine._store.dlq_list()

    assert cli(["dlq", "replay", "--id", str(second.id), "--config", str(config)]) == 0
    await engine.deliver_due()
    assert receiver.all_lsns == [4]
    assert [e.lsn for e in engine._store.dlq_list()] == [3]

    assert cli(["dlq", "replay", "--id", "999", "--config", str(config)]) == 1
    assert "no DLQ entry with id 999" in capsys.readouterr().err


async def test_dlq_replay_refuses_a_trigger_not_in_the_config(
    make_engine: Any, config: Path, receiver: Receiver, capsys: Any
) -> None:
    await dead_letter(make_engine, config, receiver, {"hook": [3]})
    capsys.readouterr()  # drop the engine's log lines
    assert cli(["dlq", "replay", "--trigger", "gone", "--config", str(config)]) == 1
    assert 'trigger "gone" is not in' in capsys.readouterr().err


async def test_dlq_purge_by_trigger_then_all(
    make_engine: Any, config: Path, receiver: Receiver, capsys: Any
) -> None:
    engine = await dead_letter(make_engine, config, receiver, {"hook": [3, 4], "other": [9]})
    capsys.readouterr()  # drop the engine's log lines
    assert cli(["dlq", "purge", "--trigger", "hook", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == 'Purged 2 DLQ entries of trigger "hook".'
    assert [e.trigger for e in engine._store.dlq_list()] == ["other"]
    assert cli(["dlq", "purge", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == "Purged 1 DLQ entry."
    assert cli(["dlq", "list", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == "The DLQ has no entries."


def test_dlq_commands_without_a_store(config: Path, capsys: Any) -> None:
    assert cli(["dlq", "list", "--config", str(config)]) == 0
    assert "The DLQ is empty (no trigger store at" in capsys.readouterr().out
    assert cli(["dlq", "replay", "--trigger", "hook", "--config", str(config)]) == 1


async def test_dlq_replay_sends_each_failed_call_again_under_its_own_key(
    make_engine: Any, tmp_path: Path, receiver: Receiver, capsys: Any
) -> None:
    """The reported case: three calls failed, one row each, and were redelivered by
    `dlq replay` as one call ``hook:31016-31018``.
    1. Three batches each match one row of "hook" (batch_size 1024); each call gets 422.
    2. `dlq replay --trigger hook` puts them back in the retry queue.
    3. The retry pass makes three calls again, with the three keys the receiver saw
       before, each for the same row; no call merges them."""
    config = tmp_path / "one.toml"
    config.write_text(ONE_HOOK.format(url=receiver.url))
    cfg = load(config)
    assert [(t.name, t.batch_size) for t in cfg.triggers] == [("hook", 1024)]
    receiver.default = Reply(422, body="unprocessable")
    engine = await make_engine(cfg.triggers, data_dir=cfg.data_dir)
    for batch_id, lsn in enumerate([31016, 31017, 31018], start=1):
        matched = {"hook": [event(lsn, key=f"k{lsn}")]}
        await engine.finish(batch(batch_id), hand_evaluation(engine, matched))
    first = [(r.headers["Idempotency-Key"], r.lsns) for r in receiver.requests]
    assert first == [
        ("hook:31016-31016", [31016]),
        ("hook:31017-31017", [31017]),
        ("hook:31018-31018", [31018]),
    ]
    assert [e.call_key for e in engine._store.dlq_list()] == [k for k, _ in first]
    receiver.default = Reply(200)
    receiver.requests.clear()
    capsys.readouterr()  # drop the engine's log lines

    assert cli(["dlq", "replay", "--trigger", "hook", "--config", str(config)]) == 0
    assert await engine.deliver_due() == 3

    assert [(r.headers["Idempotency-Key"], r.lsns) for r in receiver.requests] == first
    assert engine._store.pending() == [] and engine._store.dlq_list() == []
