"""Crash safety: a writer under concurrent load is SIGKILLed at random moments; after every
reopen each acknowledged event is present with its payload, LSNs have no gaps and what earlier
rounds kept is unchanged (the log only ever grows by a prefix-preserving append)."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.wal.crash_writer import core_of, digest, open_keyed, payload
from wal import Record, Wal

ROUNDS = 24
REPO = Path(__file__).resolve().parents[2]


READY_S = 60.0  # the writer's interpreter start, however loaded the machine


def run_and_kill(
    directory: Path, seed: str, after: float, *extra: str
) -> list[tuple[int, int, str]]:
    """Start the writer, SIGKILL it ``after`` seconds after its ``ready`` line
    (within ``READY_S``); the acks it reported."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.wal.crash_writer", str(directory), seed, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env=env,
    )
    assert child.stdout is not None
    data = bytearray()
    deadline = time.monotonic() + READY_S
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        while b"ready\n" not in data and (left := deadline - time.monotonic()) > 0:
            if sel.select(timeout=left):
                chunk = os.read(child.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                data += chunk
        assert b"ready\n" in data, f"the writer did not start within {READY_S} s"
        deadline = time.monotonic() + after
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(timeout=left):
                chunk = os.read(child.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                data += chunk
    child.send_signal(signal.SIGKILL)
    data += child.stdout.read()  # acks written before the kill are still in the pipe
    child.wait()
    child.stdout.close()
    assert child.returncode == -signal.SIGKILL, "the writer died before it was killed"
    acks = []
    for line in data.decode().splitlines()[1:]:  # after "ready"
        first, last, tag = line.split()
        acks.append((int(first), int(last), tag))
    return acks


@pytest.mark.crash
def test_sigkill_under_load_never_loses_an_acknowledged_event(tmp_path: Path) -> None:
    """1. Round r starts a writer (6 producers, tiny segments) and SIGKILLs it after a random
       0.05-0.9 s, sometimes before its first ack, sometimes mid-rotation.
    2. The parent reopens the WAL: recovery cuts any torn tail.
    3. Every acked range is present with its exact cores and payloads; LSNs are 1..head;
       every record of earlier rounds is unchanged.
    """
    directory = tmp_path / "wal"
    rng = random.Random(20240611)
    kept: list[Record] = []
    acked_total = 0
    for r in range(ROUNDS):
        acks = run_and_kill(directory, f"r{r}", rng.uniform(0.05, 0.9))
        acked_total += len(acks)
        with Wal.open(directory, segment_bytes=48 * 1024) as wal:
            records = list(wal.read(1))
            head = wal.head_lsn()
        assert [rec.lsn for rec in records] == list(range(1, head + 1)), f"round {r}: gap"
        assert records[: len(kept)] == kept, f"round {r}: earlier records changed"
        for first, last, tag in acks:
            assert last <= head, f"round {r}: acked LSN {last} lost (head {head})"
            got = records[first - 1 : last]
            want = [(core_of(tag, i), payload(tag, i)) for i in range(last - first + 1)]
            assert [(rec.core, rec.payload) for rec in got] == want, f"round {r}: {tag} differs"
        kept = records
    assert acked_total > ROUNDS * 5, "too few acks: the kills did not happen under load"


@pytest.mark.crash
def test_sigkill_never_loses_an_acknowledged_request_key(tmp_path: Path) -> None:
    """Every append carries a request key and retention keeps removing segments (so keys of
    removed segments live in the REQUESTS snapshot). After each SIGKILL at a random moment,
    every acknowledged key of every round is found with the LSNs its append got."""
    directory = tmp_path / "wal"
    rng = random.Random(20261125)
    acked: list[tuple[int, int, str]] = []
    removed_some = False
    for r in range(12):
        acked += run_and_kill(directory, f"k{r}", rng.uniform(0.1, 0.9), "keys")
        with open_keyed(directory) as wal:
            removed_some = removed_some or wal.retained_floor() > 1
            for first, last, tag in acked:
                entry = wal.find_request(tag.encode())
                assert entry is not None, f"round {r}: acknowledged key {tag} forgotten"
                assert (entry.first_lsn, entry.last_lsn, entry.digest) == (
                    first,
                    last,
                    digest(tag),
                ), f"round {r}: {tag}"
    assert len(acked) > 100, "too few acks: the kills did not happen under load"
    assert removed_some, "retention never removed a segment: the snapshot was not exercised"
