"""Helpers shared by the WAL tests (fixtures live in conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

from wal import Wal

OpenWal = Callable[..., Wal]


def events(n: int, cores: int = 4, tag: str = "e") -> list[tuple[int, bytes]]:
    """n (core, payload) items spread over ``cores`` cores, payloads unique per tag."""
    return [(i % cores, f'{{"{tag}":{i}}}'.encode()) for i in range(n)]
