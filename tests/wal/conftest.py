"""Factory fixtures for WAL tests: real directories, real files, closed after each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.wal.helpers import OpenWal
from wal import Wal


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
