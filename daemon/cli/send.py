"""``eventplane send``: NDJSON events on stdin → ``POST /v1/events`` in batches.

Batches hold ``--batch`` events (and never more than ``ingest.max_body_bytes``)
and are sent one after another, so LSNs follow stdin order: a batch is retried
until it is acknowledged before the next one goes. Progress goes to stderr when
it is a terminal; a one-line summary goes to stdout at the end.

Every request carries an ``Idempotency-Key``, ``<--key-prefix>:<its first stdin
line>`` (the prefix is random per run unless given), the same on every
attempt. Connection errors, timeouts (``--timeout`` per attempt), 408, 429,
503 and 507 are retried with that key for up to ``--retry-for`` seconds, so
a request that was stored but whose answer was lost is answered from the
daemon's de-duplication window (a replay) instead of being stored twice.

With ``--url`` given more than once (a primary and its standby), a request that
cannot connect or gets a ``standby`` answer goes to the next URL at once, with
the same key (docs/ingest.md, "Clients and retries"). With ``--route key`` each
event goes instead to the URL its collection and key pick (rendezvous hashing),
always the same one: a batch is split into one request per URL, sent side by
side, each retried at its own URL only, under ``<key>/<8 hex of the URL>``.

On a refusal it stops at once and exits 1 with the server's message, the
stdin line numbers it refers to, and what was acknowledged before it, so the
rest can be sent again with ``tail -n +LINE``. When the retries run out it
says which lines may or may not be stored and prints the command that resends
them with the same keys (``--key-prefix``, ``--from-line``): safe within the
daemon's window (``ingest.idempotency_window_s``, 900 s by default).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO, TextIO

from daemon.client import (
    RETRY_FOR_S,
    TIMEOUT_S,
    Ack,
    ClientOptions,
    EndpointAck,
    IngestConnectionError,
    IngestError,
    Retry,
    RoutedAck,
    SyncIngestClient,
    UnroutableError,
    check_key_prefix,
    new_key_prefix,
)
from daemon.config import Config

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
# Progress is redrawn at most this often (a terminal cannot show more).
PROGRESS_EVERY_S = 0.25
# A refusal lists at most this many per-event problems.
SHOWN_ERRORS = 10
# A retry's progress line is cut to this many characters (the server's message is last).
PROGRESS_WIDTH = 160
# Off a terminal, a request being retried is reported at most this often.
RETRY_NOTE_EVERY_S = 10.0
DEFAULT_BATCH = 1000


def ingest_urls(cfg: Config, urls: str | Sequence[str] | None = None) -> list[str]:
    """The ingest base URLs in failover order: every ``--url``, else ``ingest.listen``."""
    if isinstance(urls, str):
        urls = [urls]
    return list(urls) if urls else [ingest_url(cfg)]


def ingest_url(cfg: Config, url: str | None = None) -> str:
    """The ingest base URL: ``--url`` if given, else ``ingest.listen`` (wildcards via loopback)."""
    if url:
        return url
    host = cfg.ingest.listen.host
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if cfg.ingest.tls.enabled else "http"
    return f"{scheme}://{host}:{cfg.ingest.listen.port}"


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


def batches(stream: BinaryIO, size: int, max_bytes: int, from_line: int = 1) -> Iterator[Batch]:
    """Non-blank lines from stdin line ``from_line`` on, grouped by count and bytes; a
    line alone may exceed ``max_bytes`` (the daemon then answers 413 with its limit,
    which is the message the user needs). The same input, size, limit and
    ``from_line`` give the same batches: a resend gets the same keys and bodies."""
    batch = Batch()
    for lineno, line in enumerate(stream, start=1):
        if lineno < from_line or not line.strip():
            continue
        if batch.lines and (len(batch.lines) >= size or batch.nbytes + len(line) + 1 > max_bytes):
            yield batch
            batch = Batch()
        batch.add(lineno, line)
    if batch.lines:
        yield batch


class Progress:
    def __init__(
        self, out: TextIO, enabled: bool, retry_for: float = RETRY_FOR_S, failover: bool = False
    ) -> None:
        self.out = out
        self.enabled = enabled
        self.retry_for = retry_for
        self.failover = failover  # more than one URL: say where each attempt goes
        self.started = time.monotonic()
        self._drawn = 0.0
        self._noted = 0.0
        self.events = 0
        self.requests = 0
        self.retried = 0  # requests that needed more than one attempt
        self.replayed = 0  # requests the daemon answered from an earlier attempt
        self.first_lsn: int | None = None
        self.last_lsn: int | None = None
        # --route key: the first and last LSN acknowledged by each endpoint.
        self.ranges: dict[str, tuple[int, int]] = {}

    def acked(
        self, accepted: int, first_lsn: int, last_lsn: int, *, retried: bool, replayed: bool
    ) -> None:
        if self.first_lsn is None:
            self.first_lsn = first_lsn
        self.last_lsn = last_lsn
        self._count(accepted, retried=retried, replayed=replayed)

    def routed(self, ack: RoutedAck, *, retried: bool) -> None:
        """A --route key request, acknowledged at every endpoint it went to."""
        self.add_ranges(ack.acks)
        replayed = bool(ack.acks) and all(a.replayed for a in ack.acks)
        self._count(ack.accepted, retried=retried, replayed=replayed)

    def add_ranges(self, acks: Sequence[EndpointAck]) -> None:
        for a in acks:
            first = self.ranges.get(a.endpoint, (a.first_lsn, 0))[0]
            self.ranges[a.endpoint] = (first, a.last_lsn)

    def lsns(self) -> str:
        """``LSN a..b``, or per endpoint with --route key; "" before any ack."""
        if self.ranges:
            return "LSN " + ", ".join(f"{a}..{b} at {url}" for url, (a, b) in self.ranges.items())
        if self.first_lsn is None:
            return ""
        return f"LSN {self.first_lsn}..{self.last_lsn}"

    def _count(self, accepted: int, *, retried: bool, replayed: bool) -> None:
        self.events += accepted
        self.requests += 1
        self.retried += retried
        self.replayed += replayed
        now = time.monotonic()
        if self.enabled and now - self._drawn >= PROGRESS_EVERY_S:
            self._drawn = now
            self.out.write(f"\r{self.line()}  ")
            self.out.flush()

    def retrying(self, batch: Batch, number: int, retry: Retry, first: bool) -> None:
        """A request failed and waits for its next attempt: on a terminal the progress
        line says so; otherwise a line on its first retry and every RETRY_NOTE_EVERY_S."""
        at = f" at {retry.endpoint}" if self.failover else ""
        note = (
            f"request {number} ({batch.span()}): attempt {retry.attempt + 1}{at} in "
            f"{retry.wait_s:.1f} s ({retry.elapsed_s:.0f} s of --retry-for {self.retry_for:g}) "
            f"after {what_failed(retry.error)}"
        )
        now = time.monotonic()
        if self.enabled:
            self._drawn = now
            self.out.write(f"\r{note[:PROGRESS_WIDTH]}\x1b[K")
            self.out.flush()
        elif first or now - self._noted >= RETRY_NOTE_EVERY_S:
            self._noted = now
            print(f"eventplane send: {note}", file=self.out)

    def counts(self) -> str:
        extra = [
            f"{n:,} {what}"
            for n, what in ((self.retried, "retried"), (self.replayed, "replayed"))
            if n
        ]
        return f" ({', '.join(extra)})" if extra else ""

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return (
            f"sent {self.events:,} events in {self.requests:,} requests{self.counts()} "
            f"({self.events / elapsed:,.0f} events/s)"
        )

    def clear(self) -> None:
        if self.enabled and self._drawn:
            self.out.write("\r\x1b[K")
            self.out.flush()

    def summary(self) -> str:
        elapsed = time.monotonic() - self.started
        lsns = f", {self.lsns()}" if self.lsns() else ""
        return (
            f"sent {self.events} events in {self.requests} requests{self.counts()}{lsns}, "
            f"{elapsed:.2f} s ({self.events / max(elapsed, 1e-9):,.0f} events/s)"
        )


def what_failed(exc: IngestError) -> str:
    if isinstance(exc, IngestConnectionError) or exc.status is None:
        return exc.message
    return f"HTTP {exc.status}" + (f" {exc.error}" if exc.error else "") + f": {exc.message}"


def describe_failure(
    exc: IngestError, batch: Batch, number: int, *, routed: bool = False
) -> list[str]:
    """The first lines to print for a refused (or unanswered) batch; ``routed``
    (--route key): they name the endpoint of the failed part of it."""
    lines: list[str] = []
    if isinstance(exc, UnroutableError):
        where = batch.stdin_line(exc.line)
        line = f"stdin line {where}" if where is not None else "it"
        lines.append(
            f"request {number} ({batch.span()}) not sent: --route key sends each event by "
            f"its collection and key, and {line} has none to route by: {exc.reason or exc.message}"
        )
        return lines
    endpoint = f" at {exc.endpoint}" if routed and exc.endpoint else ""
    if exc.gave_up:
        lines.append(
            f"request {number} ({batch.span()}): gave up after {exc.attempts} attempts in "
            f"{exc.elapsed_s:.1f} s{endpoint}; the last: {what_failed(exc)}"
        )
        return lines
    if isinstance(exc, IngestConnectionError):
        lines.append(f"request {number} ({batch.span()}): {exc.message}")
        return lines
    status = f"HTTP {exc.status}" + (f" {exc.error}" if exc.error else "")
    where = batch.stdin_line(exc.body.get("line"))
    at = f" at stdin line {where}" if where is not None else ""
    lines.append(
        f"request {number} ({batch.span()}) refused{endpoint}, {status}{at}: {exc.message}"
    )
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


def resend_command(args: argparse.Namespace, prefix: str, size: int, line: int) -> str:
    """The ``eventplane send`` that resends from ``line`` with the same keys and bodies."""
    argv = ["eventplane", "send"]
    if getattr(args, "config", None):
        argv += ["--config", str(args.config)]
    urls = getattr(args, "url", None)
    for url in [urls] if isinstance(urls, str) else urls or []:
        argv += ["--url", str(url)]
    for flag in ("token_file", "ca_file", "cert", "key"):
        if getattr(args, flag, None):
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if getattr(args, "route", None) == "key":
        argv += ["--route", "key"]
    if size != DEFAULT_BATCH:
        argv += ["--batch", str(size)]
    argv += ["--key-prefix", prefix, "--from-line", str(line)]
    return shlex.join(argv)


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
    size = int(getattr(args, "batch", DEFAULT_BATCH) or 0)
    retry_for = getattr(args, "retry_for", None)
    retry_for = RETRY_FOR_S if retry_for is None else float(retry_for)
    timeout = getattr(args, "timeout", None)
    timeout = TIMEOUT_S if timeout is None else float(timeout)
    from_line = int(getattr(args, "from_line", None) or 1)
    problems = []
    if size < 1:
        problems.append(f"--batch must be >= 1, got {size}")
    if retry_for < 0:
        problems.append(f"--retry-for must be >= 0, got {retry_for:g}")
    if timeout <= 0:
        problems.append(f"--timeout must be > 0, got {timeout:g}")
    if from_line < 1:
        problems.append(f"--from-line must be >= 1, got {from_line}")
    prefix = getattr(args, "key_prefix", None) or new_key_prefix("send")
    try:
        check_key_prefix(prefix)
    except ValueError as exc:
        problems.append(f"--key-prefix: {exc}")
    if problems:
        for problem in problems:
            print(f"eventplane send: {problem}", file=stderr)
        return EXIT_USAGE
    from daemon.cli import access

    producer = access.from_args(args, access.ENV_TOKEN_FILE)
    urls = ingest_urls(cfg, getattr(args, "url", None))
    routed = getattr(args, "route", None) == "key"
    progress = Progress(
        stderr, enabled=stderr.isatty(), retry_for=retry_for, failover=len(urls) > 1 or routed
    )
    number = 0
    batch = Batch()
    retries = 0

    def on_retry(retry: Retry) -> None:
        nonlocal retries
        retries += 1
        progress.retrying(batch, number, retry, first=retry.attempt == 1)

    options: ClientOptions = {
        "timeout_s": timeout,
        "retry_for_s": retry_for,
        "key_prefix": prefix,
        "on_retry": on_retry,
        "token": producer.token,
        "ssl_context": producer.context,
    }
    client: SyncIngestClient[Ack] | SyncIngestClient[RoutedAck] = (
        SyncIngestClient(endpoints=urls, route="key", **options)
        if routed
        else SyncIngestClient(endpoints=urls, **options)
    )
    with client:
        for batch in batches(stdin, size, cfg.ingest.max_body_bytes, from_line):
            number += 1
            retries = 0
            try:
                ack = client.send_ndjson(b"".join(batch.lines), key=f"{prefix}:{batch.linenos[0]}")
            except IngestError as exc:
                progress.clear()
                print(
                    "eventplane send: "
                    + "\n".join(describe_failure(exc, batch, number, routed=routed)),
                    file=stderr,
                )
                acked = f"acknowledged before it: {progress.events} events"
                if progress.lsns():
                    acked += f" ({progress.lsns()})"
                first = batch.linenos[0]
                if exc.acked:
                    # Part of the batch is stored at other endpoints: only a resend
                    # under the same keys stores it once.
                    parts = ", ".join(f"{a.accepted} at {a.endpoint}" for a in exc.acked)
                    print(
                        f"  {acked}; of {batch.span()}, {parts} were acknowledged, the rest "
                        "was not" + (" or may have been" if exc.maybe_stored else "") + "; "
                        "nothing after them was sent\n"
                        "  to send the rest, feed the same input to the command below: its "
                        "requests carry the same Idempotency-Keys, so nothing is stored twice "
                        "within the daemon's de-duplication window "
                        "(ingest.idempotency_window_s, 900 s by default)\n"
                        f"    {resend_command(args, prefix, size, first)}",
                        file=stderr,
                    )
                elif exc.maybe_stored:
                    print(
                        f"  {acked}; {batch.span()} may or may not have been stored; "
                        "nothing after them was sent\n"
                        "  to send the rest, feed the same input to the command below: its "
                        "requests carry the same Idempotency-Keys, so nothing is stored twice "
                        "within the daemon's de-duplication window "
                        "(ingest.idempotency_window_s, 900 s by default)\n"
                        f"    {resend_command(args, prefix, size, first)}",
                        file=stderr,
                    )
                else:
                    if exc.gave_up:
                        acked += f"; {batch.span()} were not stored"
                    print(f"  {acked}; to send the rest: tail -n +{first}", file=stderr)
                return EXIT_FAILED
            if isinstance(ack, RoutedAck):
                progress.routed(ack, retried=retries > 0)
            else:
                progress.acked(
                    ack.accepted,
                    ack.first_lsn,
                    ack.last_lsn,
                    retried=retries > 0,
                    replayed=ack.replayed,
                )
    progress.clear()
    print(progress.summary(), file=stdout)
    return EXIT_OK
