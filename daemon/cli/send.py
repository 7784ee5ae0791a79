"""``eventplane send``: NDJSON events on stdin → ``POST /v1/events`` in batches.

Batches hold ``--batch`` events (and never more than ``ingest.max_body_bytes``)
and are sent one after another, so LSNs follow stdin order. Progress goes to
stderr when it is a terminal; a one-line summary goes to stdout at the end.

On a refusal it stops at once and exits 1 with the server's message, the
stdin line numbers it refers to, and what was acknowledged before it, so the
rest can be sent again with ``tail -n +LINE``. An acknowledged batch is never
sent twice: retries happen only for 429/503/507 (the server stored nothing) and
for connections that never opened.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any, BinaryIO, TextIO

from daemon.client import IngestConnectionError, IngestError, SyncIngestClient
from daemon.config import Config

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
# Progress is redrawn at most this often (a terminal cannot show more).
PROGRESS_EVERY_S = 0.25
# A refusal lists at most this many per-event problems.
SHOWN_ERRORS = 10
# 429/503/507 retries: the daemon says how long to wait; this many times at most.
MAX_RETRIES = 20
# A daemon that does not accept connections: retry briefly (0.5 s, then 1 s), then say so.
CONNECT_RETRIES = 2


def ingest_url(cfg: Config, url: str | None = None) -> str:
    """The ingest base URL: ``--url`` if given, else ``ingest.listen`` (wildcards via loopback)."""
    if url:
        return url
    host = cfg.ingest.listen.host
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{cfg.ingest.listen.port}"


class Batch:
    """Lines of one request and the stdin line number of each."""

    __slots__ = ("linenos", "lines", "nbytes")

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.linenos: list[int] = []
        self.nbytes = 0

    def add(self, lineno: int, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        self.lines.append(line)
        self.linenos.append(lineno)
        self.nbytes += len(line)

    def stdin_line(self, body_line: Any) -> int | None:
        """The stdin line number of the body's 1-based line ``body_line``."""
        if isinstance(body_line, int) and 1 <= body_line <= len(self.linenos):
            return self.linenos[body_line - 1]
        return None

    def span(self) -> str:
        return f"stdin lines {self.linenos[0]}-{self.linenos[-1]}"


def batches(stream: BinaryIO, size: int, max_bytes: int) -> Iterator[Batch]:
    """Non-blank lines grouped by count and bytes; a line alone may exceed ``max_bytes``
    (the daemon then answers 413 with its limit, which is the message the user needs)."""
    batch = Batch()
    for lineno, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        if batch.lines and (len(batch.lines) >= size or batch.nbytes + len(line) + 1 > max_bytes):
            yield batch
            batch = Batch()
        batch.add(lineno, line)
    if batch.lines:
        yield batch


class Progress:
    def __init__(self, out: TextIO, enabled: bool) -> None:
        self.out = out
        self.enabled = enabled
        self.started = time.monotonic()
        self._drawn = 0.0
        self.events = 0
        self.requests = 0
        self.first_lsn: int | None = None
        self.last_lsn: int | None = None

    def acked(self, accepted: int, first_lsn: int, last_lsn: int) -> None:
        self.events += accepted
        self.requests += 1
        if self.first_lsn is None:
            self.first_lsn = first_lsn
        self.last_lsn = last_lsn
        now = time.monotonic()
        if self.enabled and now - self._drawn >= PROGRESS_EVERY_S:
            self._drawn = now
            self.out.write(f"\r{self.line()}  ")
            self.out.flush()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return (
            f"sent {self.events:,} events in {self.requests:,} requests "
            f"({self.events / elapsed:,.0f} events/s)"
        )

    def clear(self) -> None:
        if self.enabled and self._drawn:
            self.out.write("\r" + " " * 78 + "\r")
            self.out.flush()

    def summary(self) -> str:
        elapsed = time.monotonic() - self.started
        lsns = f", LSN {self.first_lsn}..{self.last_lsn}" if self.first_lsn is not None else ""
        return (
            f"sent {self.events} events in {self.requests} requests{lsns}, {elapsed:.2f} s "
            f"({self.events / max(elapsed, 1e-9):,.0f} events/s)"
        )


def describe_failure(exc: IngestError, batch: Batch, number: int) -> list[str]:
    """The lines to print for a refused (or unanswered) batch."""
    lines: list[str] = []
    if isinstance(exc, IngestConnectionError):
        lines.append(f"request {number} ({batch.span()}): {exc.message}")
        return lines
    status = f"HTTP {exc.status}" + (f" {exc.error}" if exc.error else "")
    where = batch.stdin_line(exc.body.get("line"))
    at = f" at stdin line {where}" if where is not None else ""
    lines.append(f"request {number} ({batch.span()}) refused, {status}{at}: {exc.message}")
    errors = exc.body.get("errors")
    if isinstance(errors, list):
        for item in errors[:SHOWN_ERRORS]:
            if not isinstance(item, dict):
                continue
            lineno = batch.stdin_line(item.get("line"))
            if lineno is None and isinstance(item.get("index"), int):
                lineno = batch.stdin_line(item["index"] + 1)
            field = item.get("field")
            label = f"stdin line {lineno}" if lineno is not None else f"event {item.get('index')}"
            lines.append(f"  {label}" + (f" {field}" if field else "") + f": {item.get('reason')}")
        if len(errors) > SHOWN_ERRORS:
            lines.append(f"  ... and {len(errors) - SHOWN_ERRORS} more")
    return lines


def main(
    args: argparse.Namespace,
    cfg: Config,
    stdin: BinaryIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    stdin = sys.stdin.buffer if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    size = int(getattr(args, "batch", 1000) or 0)
    if size < 1:
        print(f"eventplane send: --batch must be >= 1, got {size}", file=stderr)
        return EXIT_USAGE
    url = ingest_url(cfg, getattr(args, "url", None))
    progress = Progress(stderr, enabled=stderr.isatty())
    number = 0
    with SyncIngestClient(url, max_retries=MAX_RETRIES, connect_retries=CONNECT_RETRIES) as client:
        for batch in batches(stdin, size, cfg.ingest.max_body_bytes):
            number += 1
            try:
                ack = client.send_ndjson(b"".join(batch.lines))
            except IngestError as exc:
                progress.clear()
                print(
                    "eventplane send: " + "\n".join(describe_failure(exc, batch, number)),
                    file=stderr,
                )
                acked = f"acknowledged before it: {progress.events} events"
                if progress.last_lsn is not None:
                    acked += f" (LSN {progress.first_lsn}..{progress.last_lsn})"
                if isinstance(exc, IngestConnectionError) and exc.maybe_sent:
                    acked += f"; request {number} may or may not have been stored"
                print(f"  {acked}; to send the rest: tail -n +{batch.linenos[0]}", file=stderr)
                return EXIT_FAILED
            progress.acked(ack.accepted, ack.first_lsn, ack.last_lsn)
    progress.clear()
    print(progress.summary(), file=stdout)
    return EXIT_OK
