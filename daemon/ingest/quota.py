"""Per-producer quotas: ``max_events_per_s`` and ``max_bytes_per_s`` of an
``[[ingest.tokens]]`` entry, each a token bucket holding one second's worth.

A producer whose bucket is empty (or in debt) is refused at admission, before
its body is read or parsed: a noisy producer costs little. Otherwise the
request is charged after it was parsed and before it is stored: its events
and its body bytes. It passes when each bucket holds at least its size, or is
full when the request is bigger than a second's worth (so such a request goes
through at the average rate instead of never); the charge may then leave the
bucket in debt, which refills first. Over the limit: 429 with ``Retry-After``,
the seconds the bucket needs to hold the request, and nothing is stored.
docs/security.md, "Quotas".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from daemon.config import ProducerToken


class TokenBucket:
    __slots__ = ("level", "rate", "stamp")

    def __init__(self, rate: int, now: float) -> None:
        self.rate = float(rate)  # per second; also the capacity (one second's worth)
        self.level = self.rate
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.rate, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, n: int) -> float:
        """Seconds until the bucket can take ``n``; 0 when it can now."""
        need = min(float(n), self.rate)
        return 0.0 if self.level >= need else (need - self.level) / self.rate


class Quotas:
    """The buckets of every producer with a quota, by producer name."""

    __slots__ = ("_buckets", "_clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}

    def configure(self, tokens: tuple[ProducerToken, ...]) -> None:
        """Buckets for ``tokens``; a producer whose limits did not change keeps its own
        (a reload does not hand a noisy producer a fresh second)."""
        now = self._clock()
        old = self._buckets
        new: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}
        for t in tokens:
            if t.max_events_per_s is None and t.max_bytes_per_s is None:
                continue
            kept = old.get(t.name)
            if kept is not None and _rates(kept) == (t.max_events_per_s, t.max_bytes_per_s):
                new[t.name] = kept
                continue
            new[t.name] = (
                None if t.max_events_per_s is None else TokenBucket(t.max_events_per_s, now),
                None if t.max_bytes_per_s is None else TokenBucket(t.max_bytes_per_s, now),
            )
        self._buckets = new

    def admit(self, producer: str) -> int | None:
        """None while each of ``producer``'s buckets holds something; else the whole
        seconds until they do (``Retry-After``, >= 1)."""
        buckets = self._buckets.get(producer)
        if buckets is None:
            return None
        now = self._clock()
        wait = 0.0
        for bucket in buckets:
            if bucket is not None:
                bucket.refill(now)
                wait = max(wait, bucket.wait_s(1))
        return max(1, math.ceil(wait)) if wait > 0 else None

    def charge(self, producer: str, events: int, nbytes: int) -> int | None:
        """Take the request from ``producer``'s buckets and return None, or take
        nothing and return the whole seconds to wait (``Retry-After``, >= 1)."""
        buckets = self._buckets.get(producer)
        if buckets is None:
            return None
        now = self._clock()
        wait = 0.0
        for bucket, n in zip(buckets, (events, nbytes), strict=True):
            if bucket is not None:
                bucket.refill(now)
                wait = max(wait, bucket.wait_s(n))
        if wait > 0:
            return max(1, math.ceil(wait))
        for bucket, n in zip(buckets, (events, nbytes), strict=True):
            if bucket is not None:
                bucket.level -= n
        return None


def _rates(buckets: tuple[TokenBucket | None, TokenBucket | None]) -> tuple[int | None, ...]:
    return tuple(None if b is None else int(b.rate) for b in buckets)
