"""Helpers shared by the WAL tests (fixtures live in conftest.py)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from wal import Wal

OpenWal = Callable[..., Wal]
REPO = Path(__file__).resolve().parents[2]


def events(n: int, cores: int = 4, tag: str = "e") -> list[tuple[int, bytes]]:
    """n (core, payload) items spread over ``cores`` cores, payloads unique per tag."""
    return [(i % cores, f'{{"{tag}":{i}}}'.encode()) for i in range(n)]


def failing_once(real: Callable[..., Any], error: int) -> Callable[..., Any]:
    """A side effect that fails the first call with ``error`` and passes later ones through."""
    calls = []

    def side_effect(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise OSError(error, f"injected {errno.errorcode[error]}")
        return real(*args)

    return side_effect


@contextmanager
def ready_child(module: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``python -m module *args`` once it printed ``ready`` (it holds a lock); killed at exit."""
    child = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        text=True,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline() == "ready\n", f"{module} did not get ready"
        yield child
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
