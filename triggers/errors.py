"""Typed errors of the triggers package."""

from __future__ import annotations


class TriggerError(Exception):
    """Base error of the triggers package."""

    retriable = False


class PermanentError(TriggerError):
    """Raised by a python action to send its rows straight to the DLQ."""

    retriable = False


class RetriableActionError(TriggerError):
    """A transient action failure (timeout, 5xx, 429): retried with backoff."""

    retriable = True

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
