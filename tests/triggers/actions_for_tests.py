"""Python actions the trigger tests name as ``tests.triggers.actions_for_tests:<func>``."""

from __future__ import annotations

from typing import Any

from triggers import PermanentError

CALLS: list[tuple[str, list[int], list[Any], list[str]]] = []
FLAKY_FAILURES: list[int] = []  # pop one per call: fail while non-empty


def _record(name: str, rows: list[dict[str, Any]]) -> None:
    CALLS.append(
        (name, [r["lsn"] for r in rows], [r["new"] for r in rows],
         [r["idempotency_key"] for r in rows])
    )  # fmt: skip


def record(rows: list[dict[str, Any]]) -> None:
    _record("record", rows)


async def record_async(rows: list[dict[str, Any]]) -> None:
    _record("record_async", rows)


def reject(rows: list[dict[str, Any]]) -> None:
    raise PermanentError("no such customer")


async def flaky_async(rows: list[dict[str, Any]]) -> None:
    if FLAKY_FAILURES:
        FLAKY_FAILURES.pop()
        raise RuntimeError("flaky once")
    _record("flaky_async", rows)


NOT_CALLABLE = 42
