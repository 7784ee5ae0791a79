"""Triggers: specs, evaluation inside micro-batches, actions, retry queue and DLQ."""

from triggers.errors import PermanentError, TriggerError

__all__ = ["PermanentError", "TriggerError"]
