"""Factory fixtures for WAL tests: real directories, real files, closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from wal import Wal

OpenWal = Callable[..., Wal]


@pytest.fixture
def wal_dir(tmp_path: Path) -> Path:
    return tmp_path / "wal"


@pytest.fixture
def open_wal(wal_dir: Path) -> Iterator[OpenWal]:
    """``open_wal(**options)`` opens the test's WAL; every one still open is closed at the end."""
    opened: list[Wal] = []

    def factory(directory: Path | None = None, **options: Any) -> Wal:
        wal = Wal.open(directory or wal_dir, **options)
        opened.append(wal)
        return wal

    yield factory
    for wal in opened:
        wal.close()


def events(n: int, cores: int = 4, tag: str = "e") -> list[tuple[int, bytes]]:
    """n (core, payload) items spread over ``cores`` cores, payloads unique per tag."""
    return [(i % cores, f'{{"{tag}":{i}}}'.encode()) for i in range(n)]
