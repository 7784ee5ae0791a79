"""The ingest-scaling prototype still runs end to end, and loses nothing it acknowledged.

Tiny durations: the numbers are not checked, the WAL's contents are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_ingest_scaling as scaling


def test_hand_off_message_carries_the_items_and_the_key_unchanged() -> None:
    items = [(3, b"\x98\xa6orders"), (0, b""), (1, b"x" * 70_000)]
    digest = bytes(range(16))
    message = scaling.pack_request(42, items, b"key-1", digest)
    body_len, rid, n, key_len, got_digest = scaling._REQ.unpack_from(message)
    assert (body_len, rid, n, key_len, got_digest) == (
        len(message) - scaling._REQ.size, 42, 3, 5, digest
    )  # fmt: skip
    key, got = scaling.unpack_request(message[scaling._REQ.size :], n, key_len)
    assert key == b"key-1"
    assert got == items
    assert all(type(p) is bytes for _c, p in got)  # what Wal.append accepts


def test_bench_scaling_runs_and_reports_every_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = ["--duration", "0.4", "--warmup", "0.2", "--repeat", "1", "--clients", "2"]
    argv += ["--batch", "100", "--rate", "5000", "--floor", "--json", str(out)]
    rc = scaling.main(argv)
    text = capsys.readouterr().out
    assert rc == 0, text
    labels = ("today: ingest + WAL", "eventplane run, no Spark", "1 worker(s) + WAL owner")
    for label in (*labels, "2 worker(s) + floor owner"):
        assert label in text, text
    assert "hand-off pack (worker)" in text and "Model with the plane in the owner" in text
    assert "Model with the floor owner" in text
    result = json.loads(out.read_text())
    assert [s["name"] for s in result["sides"]] == ["today", "daemon", "w1", "w2", "w2floor"]
    for side in result["sides"]:
        assert side["median"]["events_per_s"] > 0 and side["p99_ms"] > 0, side
    w2 = result["sides"][3]["stats"]
    assert w2["owner"]["messages"] > 0 and w2["workers"]["messages"] == w2["owner"]["messages"]


@pytest.mark.crash
def test_a_killed_worker_loses_no_acknowledged_event_and_stores_none_twice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGKILL one of two workers half way; producers retry with their key on the other.
    The WAL must hold every acknowledged event exactly once, at the LSNs of its ack."""
    rc = scaling.main(["--check", "3000", "--batch", "100", "--clients", "4", "--kill-worker"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "worker killed: yes" in text, text
    assert "3,000 acknowledged events in 30 requests" in text, text
    assert "every acknowledged event is in the WAL once" in text, text


async def test_the_owner_answers_a_key_from_any_worker_and_refuses_it_for_another_body(
    tmp_path: Path,
) -> None:
    """The claim lives in the owner: a retry on a fresh connection (either worker)
    gets the first LSNs back, and the same key with another body gets 422."""
    import aiohttp

    from bench.bench_ingest import make_bodies

    first_body, other_body = make_bodies(2, 10)
    side = scaling.Split("keys", tmp_path, 2, 4)
    headers = {"Content-Type": "application/x-ndjson", "Idempotency-Key": "k-1"}
    answers = []
    try:
        for body in (first_body, first_body, first_body, other_body):
            async with (
                aiohttp.ClientSession() as session,
                session.post(side.url, data=body, headers=headers) as resp,
            ):
                answers.append((resp.status, await resp.json()))
    finally:
        stats = side.stop()
    assert [status for status, _ in answers] == [200, 200, 200, 422], answers
    lsns = [(a["first_lsn"], a["last_lsn"]) for _, a in answers[:3]]
    assert lsns == [(1, 10)] * 3
    assert answers[3][1]["error"] == "idempotency_key_reused"
    assert stats["owner"].replays == 2
