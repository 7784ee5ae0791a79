"""foreachBatch handlers the tests name in ``[[cdc.handlers]]``."""

from __future__ import annotations

from typing import Any

CALLS: list[tuple[int, int, list[str]]] = []  # (batch_id, rows, columns)


def record(df: Any, batch_id: int) -> None:
    CALLS.append((batch_id, df.count(), list(df.columns)))


def explode(df: Any, batch_id: int) -> None:
    raise RuntimeError(f"handler failed on batch {batch_id}")


NOT_CALLABLE = 42
