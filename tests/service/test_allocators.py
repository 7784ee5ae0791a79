"""Allocator settings the daemon applies before any thread starts
(``daemon.service.app.tune_malloc``)."""

from __future__ import annotations

import os

import pytest

from daemon.service import app


class FakeLibc:
    """Stands in for the C library, so the test process keeps its own arenas."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> FakeLibc:
    fake = FakeLibc()
    monkeypatch.setattr(app.ctypes, "CDLL", lambda name: fake)
    for name in ("MALLOC_ARENA_MAX", "MIMALLOC_PURGE_DELAY"):
        monkeypatch.setenv(name, "")  # so that undo restores what was there
        monkeypatch.delenv(name)
    return fake


def test_one_malloc_arena_and_immediate_arrow_purge_by_default(libc: FakeLibc) -> None:
    app.tune_malloc()

    assert libc.calls == [(-8, app.MALLOC_ARENAS)]  # M_ARENA_MAX
    assert os.environ["MIMALLOC_PURGE_DELAY"] == "0"


def test_the_operators_allocator_environment_wins(
    libc: FakeLibc, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.setenv("MIMALLOC_PURGE_DELAY", "250")

    app.tune_malloc()

    assert libc.calls == []
    assert os.environ["MIMALLOC_PURGE_DELAY"] == "250"
