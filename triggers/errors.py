"""Typed errors of the triggers package.

Retry policy lives on the class (``retriable``): dispatch code asks the error,
never a string.
"""

from __future__ import annotations


class TriggerError(Exception):
    """Base error of the triggers package."""

    retriable = False


class PermanentError(TriggerError):
    """Raised by a python action to send its rows straight to the DLQ.

    The webhook action raises it too for a 4xx answer other than 408 and 429.
    """

    retriable = False


class RetriableActionError(TriggerError):
    """A transient action failure (timeout, 5xx, 429): retried with backoff."""

    retriable = True

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TriggerConfigError(TriggerError):
    """Trigger specs failed validation; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        lines = "\n  ".join(self.errors)
        super().__init__(f"{len(self.errors)} trigger error(s)\n  {lines}")


class TriggerEvaluationError(TriggerError):
    """A trigger's ``when`` (or emit expression) failed at run time in Spark.

    The batch does not commit; the executor retries it. Fix the trigger and
    reload (SIGHUP), or set ``enabled = false``: the retried batch then uses
    the new set.
    """

    retriable = True


class StoreError(TriggerError):
    """The retry/DLQ store cannot be opened or has an unknown layout."""


class RetryLoopError(TriggerError):
    """The background retry loop failed repeatedly and stopped."""
