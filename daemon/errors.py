"""Typed errors of the daemon package.

Retry policy lives on the class (``retriable``) so dispatch code asks the
error, not a string. Messages say what happened, where, and what to do.
"""

from __future__ import annotations


class DaemonError(Exception):
    """Base error of the event plane."""

    retriable = False


class ConfigError(DaemonError):
    """The configuration is invalid; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str], source: str = "config") -> None:
        self.errors = list(errors)
        self.source = source
        lines = "\n  ".join(self.errors)
        super().__init__(f"{source}: {len(self.errors)} error(s)\n  {lines}")


class IdentityMismatchError(DaemonError):
    """A state file belongs to another WAL or another ``cores`` count."""


class LsnRegressionError(DaemonError):
    """An LSN went backwards where the protocol requires it to grow."""


class ConsumerFailedError(DaemonError):
    """A consumer could not deliver its core's events (fail-stop)."""


class ExecutorError(DaemonError):
    """A micro-batch failed to execute; retried with backoff."""

    retriable = True
