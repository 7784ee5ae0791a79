"""Helpers shared by the WAL tests (fixtures live in conftest.py)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

from wal import Wal

OpenWal = Callable[..., Wal]


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
