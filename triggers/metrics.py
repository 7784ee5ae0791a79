"""The metric seams the trigger engine writes to, typed structurally.

``daemon.metrics.Metrics`` satisfies :class:`TriggerMetrics` (prometheus
``Counter``/``Gauge``/``Histogram``); the package never imports it.
"""

from __future__ import annotations

from typing import Protocol


class Incrementer(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


class Setter(Protocol):
    def set(self, value: float) -> None: ...


class CounterVec(Protocol):
    def labels(self, *values: str) -> Incrementer: ...


class GaugeVec(Protocol):
    def labels(self, *values: str) -> Setter: ...


class HistogramVec(Protocol):
    def labels(self, *values: str) -> Observer: ...


class TriggerMetrics(Protocol):
    """``trigger_*`` and ``dlq_*`` series of docs/operating.md (per-trigger where labelled)."""

    @property
    def trigger_fires(self) -> CounterVec: ...  # labels: trigger

    @property
    def trigger_successes(self) -> CounterVec: ...  # labels: trigger

    @property
    def trigger_failures(self) -> CounterVec: ...  # labels: trigger, kind

    @property
    def trigger_action_latency(self) -> HistogramVec: ...  # labels: trigger

    @property
    def trigger_paused_rows(self) -> GaugeVec: ...  # labels: trigger

    @property
    def retry_depth(self) -> Setter: ...

    @property
    def dlq_entries(self) -> Setter: ...

    @property
    def dlq_evicted(self) -> Incrementer: ...


class _Nothing:
    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def labels(self, *values: str) -> _Nothing:
        return self


class NullMetrics:
    """Discards everything: for tools and tests that do not scrape."""

    def __init__(self) -> None:
        nothing = _Nothing()
        self.trigger_fires = nothing
        self.trigger_successes = nothing
        self.trigger_failures = nothing
        self.trigger_action_latency = nothing
        self.trigger_paused_rows = nothing
        self.retry_depth = nothing
        self.dlq_entries = nothing
        self.dlq_evicted = nothing
