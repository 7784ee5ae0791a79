"""The daemon's Prometheus series, importable from the service layer as before.

The registry lives in :mod:`daemon.metrics`, below the plane, the executor and
ingest, which write to it; this module re-exports it so ``service/`` code, tests
and benches keep their import.
"""

from __future__ import annotations

from daemon.metrics import (
    BACKPRESSURE_VALUES,
    CATCHUP_REASONS,
    MODE_VALUES,
    PREFIX,
    Metrics,
)

__all__ = ["BACKPRESSURE_VALUES", "CATCHUP_REASONS", "MODE_VALUES", "PREFIX", "Metrics"]
