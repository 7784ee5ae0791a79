"""One monotonic budget shared by every shutdown step.

Each drain step takes ``deadline.remaining()``, so the steps together never
outlast the budget (and the budget stays below systemd's TimeoutStopSec).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Deadline:
    __slots__ = ("_clock", "_end", "budget")

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.budget = budget_s
        self._end = clock() + budget_s

    def remaining(self, floor: float = 0.0) -> float:
        """Seconds left, never below ``floor`` (a last step may get a token slice)."""
        return max(floor, self._end - self._clock())

    def expired(self) -> bool:
        return self._clock() >= self._end
