"""Triggers: specs, evaluation inside micro-batches, actions, retry queue and DLQ.

The package does not import the daemon: ``TriggerEngine`` takes the specs,
the data directory, metrics, an emitter and an HTTP session by injection.
"""

from triggers.engine import TriggerEngine
from triggers.errors import (
    PermanentError,
    RetriableActionError,
    TriggerConfigError,
    TriggerError,
    TriggerEvaluationError,
)
from triggers.spec import MAX_DEPTH, Retry, Spec, compile_specs
from triggers.store import TriggerStore, store_path

__all__ = [
    "MAX_DEPTH",
    "PermanentError",
    "RetriableActionError",
    "Retry",
    "Spec",
    "TriggerConfigError",
    "TriggerEngine",
    "TriggerError",
    "TriggerEvaluationError",
    "TriggerStore",
    "compile_specs",
    "store_path",
]
