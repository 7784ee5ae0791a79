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
    """Spark itself failed while evaluating the triggers (not an error about a row).

    A row that makes a ``when`` or emit expression fail does not raise: it
    goes to that trigger's DLQ (``triggers.evaluate``, poison rows). This
    error means the Spark job failed without such a reason (py4j, a stopped
    session, an internal error): the batch does not commit and the executor
    retries it.
    """

    retriable = True


class StoreError(TriggerError):
    """The retry/DLQ store cannot be opened or has an unknown layout."""


class UnknownTriggerError(TriggerError):
    """A trigger name that is not configured (pause, resume)."""

    def __init__(self, name: str, names: list[str]) -> None:
        self.name = name
        self.names = tuple(names)
        super().__init__(
            f"no trigger {name!r}; the triggers are: {', '.join(self.names) or 'none'}"
        )
