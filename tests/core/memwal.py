"""An in-memory stand-in with the shape of :class:`wal.Wal` (used until, and
besides, the real WAL in tests that need to script read failures cheaply)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from wal.errors import BelowRetainedFloorError
from wal.record import Record


class MemoryWal:
    def __init__(self, wal_id: str = "mem-wal", cores: int = 4) -> None:
        self.wal_id = wal_id
        self.records: list[Record] = []
        self._seq = [0] * cores
        self._listener: Callable[[list[Record]], None] | None = None
        self.floor = 1
        self.truncations: list[int] = []

    def set_listener(self, fn: Callable[[list[Record]], None]) -> None:
        self._listener = fn

    def head_lsn(self) -> int:
        return self.records[-1].lsn if self.records else 0

    def retained_floor(self) -> int:
        return self.floor

    def append_blocking(self, items: Sequence[tuple[int, bytes]]) -> tuple[int, int]:
        group = []
        lsn = self.head_lsn()
        for core, payload in items:
            lsn += 1
            self._seq[core] += 1
            group.append(Record(lsn, core, self._seq[core], payload))
        self.records.extend(group)
        if self._listener is not None:
            self._listener(group)
        return group[0].lsn, group[-1].lsn

    async def append(self, items: Sequence[tuple[int, bytes]]) -> tuple[int, int]:
        return self.append_blocking(items)

    def read(
        self, from_lsn: int, *, core: int | None = None, to_lsn: int | None = None
    ) -> Iterator[Record]:
        if from_lsn < self.floor and self.records:
            raise BelowRetainedFloorError(from_lsn, self.floor)
        snapshot = list(self.records)
        return (
            r
            for r in snapshot
            if r.lsn >= from_lsn
            and (core is None or r.core == core)
            and (to_lsn is None or r.lsn <= to_lsn)
        )

    def truncate_below(self, lsn: int) -> int:
        self.truncations.append(lsn)
        self.floor = max(self.floor, lsn)
        return 0
