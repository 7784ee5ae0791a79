"""Typed errors of the daemon package.

Retry policy lives on the class (``retriable``) where a caller reads it: the
ingest client (daemon/client.py) retries an ``IngestError`` only when it says
so. The planner retries a failed stage with backoff unless its error, or an
error it was raised from, is a ``DaemonError`` whose class says
``retriable = False`` (``retry_cannot_cure``): the stage then stops until an
operator resumes it. A class that says nothing (``None``) is retried.
Messages say what happened, where, and what to do.
"""

from __future__ import annotations


class DaemonError(Exception):
    """Base error of the event plane."""

    # True: retry; False: retrying cannot cure it; None: the class does not say
    # (the planner retries it, the ingest client does not).
    retriable: bool | None = None


class ConfigError(DaemonError):
    """The configuration is invalid; ``errors`` holds one line per problem."""

    retriable = False

    def __init__(self, errors: list[str], source: str = "config") -> None:
        self.errors = list(errors)
        self.source = source
        lines = "\n  ".join(self.errors)
        super().__init__(f"{source}: {len(self.errors)} error(s)\n  {lines}")


class IdentityMismatchError(DaemonError):
    """A state file belongs to another WAL or another ``cores`` count."""

    retriable = False


class LsnRegressionError(DaemonError):
    """An LSN went backwards where the protocol requires it to grow."""


class ConsumerFailedError(DaemonError):
    """A consumer could not deliver its core's events (fail-stop)."""


class ExecutorError(DaemonError):
    """A micro-batch failed to execute; the planner retries it with backoff."""


class UnknownStreamError(DaemonError):
    """No CDC stream of that name is configured."""


def retry_cannot_cure(exc: BaseException) -> DaemonError | None:
    """The error of ``exc``'s cause chain whose class says ``retriable = False``
    (None: retrying may cure it: S3, OS, py4j and lease errors among others)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, DaemonError) and type(cur).retriable is False:
            return cur
        cur = cur.__cause__
    return None


# Longest error text kept for status, logs and health (Java traces are long).
ERROR_TEXT_CHARS = 600


def error_text(exc: BaseException | str, limit: int = ERROR_TEXT_CHARS) -> str:
    """One line a person can read for ``exc``: its type and message, for a Java
    error the Spark exception and its root cause instead of a stack trace."""
    if isinstance(exc, str):
        return exc[:limit]
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    head = lines[0]
    if head.startswith("An error occurred while calling") and len(lines) > 1:
        head = lines[1].lstrip(": ")  # py4j: the Java exception is the next line
    causes = [ln.removeprefix("Caused by: ") for ln in lines if ln.startswith("Caused by: ")]
    if causes and causes[-1] not in head:
        head = f"{head} (root cause: {causes[-1]})"
    text = f"{type(exc).__name__}: {head}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ArchiveUnavailable(DaemonError):
    """The WAL archive cannot take events now (an outage, over its byte bound,
    fenced by a new holder): nothing unarchived is acknowledged (docs/wal.md,
    "The archive"). ``fenced``: for good in this process."""

    def __init__(self, message: str, *, fenced: bool = False) -> None:
        super().__init__(message)
        self.fenced = fenced


class ArchiveRefusedError(DaemonError):
    """The archive cannot be used by this data_dir (another WAL's, a gap, held)."""
