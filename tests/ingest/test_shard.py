"""Shard assignment is a fixed function: same answer in every process, forever."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections import Counter
from typing import Any
from zlib import crc32

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.shard import core_of
from tests.ingest.conftest import StartIngest, event, ndjson, post, stored

# Pinned outputs: changing any of them re-shards every existing key and breaks
# per-key order across an upgrade (invariant 3). Do not update them to pass.
GOLDEN = [
    ("orders", "order-1", 4, 3),
    ("orders", "order-2", 4, 1),
    ("users", "alice", 8, 0),
    ("users", "", 3, 1),
    ("", "x", 16, 9),
    ("événements", "clé-Ω", 7, 1),
    ("a", "bc", 1024, 965),
    ("ab", "c", 1024, 770),
]


def reference(collection: str, key: str, cores: int) -> int:
    """The documented formula, written out plainly."""
    c = collection.encode()
    h = crc32(struct.pack("<I", len(c)) + c + key.encode())
    return (h * cores) >> 32


@pytest.mark.parametrize(("collection", "key", "cores", "core"), GOLDEN)
def test_pinned_assignments_never_change(collection: str, key: str, cores: int, core: int) -> None:
    assert core_of(collection, key, cores) == core


# JSON strings decode to valid Unicode: no lone surrogates (category Cs).
_TEXT = st.characters(blacklist_categories=("Cs",))


@given(st.text(_TEXT, max_size=40), st.text(_TEXT, max_size=80), st.integers(1, 256))
def test_core_of_matches_the_documented_formula(collection: str, key: str, cores: int) -> None:
    got = core_of(collection, key, cores)
    assert 0 <= got < cores
    assert got == reference(collection, key, cores)


def test_same_answers_in_processes_with_different_hash_seeds() -> None:
    keys = [("orders", f"order-{i}") for i in range(200)] + [("users", "ü"), ("x" * 300, "")]
    here = [core_of(c, k, 7) for c, k in keys]
    script = (
        "import json, sys; from daemon.shard import core_of; "
        "keys = json.load(sys.stdin); print(json.dumps([core_of(c, k, 7) for c, k in keys]))"
    )
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script],
            input=json.dumps(keys),
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        assert json.loads(out.stdout) == here


def test_length_prefix_keeps_collection_and_key_apart() -> None:
    assert core_of("a", "bc", 1024) != core_of("ab", "c", 1024)


def test_sequential_keys_spread_evenly_over_cores() -> None:
    for cores in (2, 3, 4, 7, 16):
        counts = Counter(core_of("orders", f"order-{i}", cores) for i in range(20_000))
        expected = 20_000 / cores
        assert set(counts) == set(range(cores))
        assert all(abs(n - expected) < 0.1 * expected for n in counts.values()), counts


def test_one_core_always_gets_zero() -> None:
    assert {core_of("c", str(i), 1) for i in range(100)} == {0}


def test_zero_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="cores must be >= 1"):
        core_of("c", "k", 0)


async def test_ingest_assigns_the_same_core_as_core_of(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Any
) -> None:
    server = await start_ingest(cores=5)
    events = [event(i, collection=f"c{i % 3}") for i in range(300)]
    status, _, _ = await post(http, server, ndjson(events))
    assert status == 200
    records = stored(wal)
    assert len(records) == 300
    for _lsn, core, ev in records:
        assert core == core_of(ev.collection, ev.key, 5)
