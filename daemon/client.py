"""A small producer client for the ingest API (``POST /v1/events``).

Two flavours with the same behaviour: :class:`IngestClient` (asyncio, aiohttp)
and :class:`SyncIngestClient` (blocking, standard library only; one kept-alive
``http.client`` connection, because ``urllib.request`` opens a new connection
per request).

- A call returns :class:`Ack` (``accepted``, ``first_lsn``, ``last_lsn``) only
  when the daemon acknowledged the whole request as durable.
- A refusal raises a typed :class:`IngestError` carrying the HTTP status, the
  server's error word and message, and the full JSON body (a 422 has
  ``errors``: index, field, reason per problem).
- 429, 503 and 507 are retried after the server's ``Retry-After`` (bounded by
  ``max_retries`` and ``max_wait_s``); a connection that could not be opened
  is retried with backoff ``connect_retries`` times, since nothing was sent.
  A connection lost *after* the request went out raises
  :class:`IngestConnectionError` with ``maybe_sent=True``: the events may or
  may not be durable, and only the caller can decide whether a duplicate is
  better than a loss. Nothing acknowledged is ever resent.
"""

from __future__ import annotations

import asyncio
import email.utils
import http.client
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import msgspec

from daemon.errors import DaemonError

NDJSON = "application/x-ndjson"
EVENTS_PATH = "/v1/events"
DEFAULT_URL = "http://127.0.0.1:8470"
# Reuse an idle connection only while it is surely open: the daemon closes
# idle connections after ingest.header_timeout_s (10 s by default).
IDLE_REUSE_S = 5.0
# Without a Retry-After header: exponential backoff from this, capped by max_wait_s.
BACKOFF_S = 0.5

_encode = msgspec.json.Encoder().encode


class Ack(NamedTuple):
    accepted: int
    first_lsn: int
    last_lsn: int


class IngestError(DaemonError):
    """The ingest API refused a request (``status`` set) or could not be reached."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        error: str = "",
        body: Mapping[str, Any] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error = error
        self.body: Mapping[str, Any] = body or {}
        self.retry_after = retry_after


class BadRequestError(IngestError):
    """400: the body is not valid NDJSON/JSON (``body`` has line, column, position)."""


class PayloadTooLargeError(IngestError):
    """413: the body, an event or the event count is over the daemon's limit."""


class UnsupportedMediaTypeError(IngestError):
    """415: wrong Content-Type."""


class InvalidEventsError(IngestError):
    """422: some events are invalid; ``errors`` lists index, field and reason."""

    @property
    def errors(self) -> list[dict[str, Any]]:
        return list(self.body.get("errors", []))


class OverloadedError(IngestError):
    """429: consumers lag over the daemon's limit; retry after ``retry_after``."""

    retriable = True


class UnavailableError(IngestError):
    """503: the daemon is draining or its WAL cannot take writes."""

    retriable = True


class InsufficientStorageError(IngestError):
    """507: the WAL's volume is full; nothing was stored; retry after ``retry_after``."""

    retriable = True


class IngestConnectionError(IngestError):
    """No HTTP answer. ``maybe_sent`` says whether the request may have arrived."""

    def __init__(self, message: str, *, maybe_sent: bool) -> None:
        super().__init__(message)
        self.maybe_sent = maybe_sent
        self.retriable = not maybe_sent


_BY_STATUS: dict[int, type[IngestError]] = {
    400: BadRequestError,
    413: PayloadTooLargeError,
    415: UnsupportedMediaTypeError,
    422: InvalidEventsError,
    429: OverloadedError,
    503: UnavailableError,
    507: InsufficientStorageError,
}


def encode_events(events: Iterable[Mapping[str, Any]]) -> bytes:
    """NDJSON: one compact JSON object per line."""
    return b"".join(_encode(e) + b"\n" for e in events)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def error_from_response(status: int, body: bytes, retry_after: str | None) -> IngestError:
    """The typed error for a non-200 answer, carrying the server's own message."""
    doc: Any
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        doc = None
    if isinstance(doc, dict):
        message = str(doc.get("message") or doc.get("error") or f"HTTP {status}")
        error = str(doc.get("error", ""))
    else:
        doc = {}
        text = body.decode("utf-8", "replace").strip()
        message = f"HTTP {status}" + (f": {text[:500]}" if text else "")
        error = ""
    cls = _BY_STATUS.get(status, IngestError)
    return cls(
        message, status=status, error=error, body=doc, retry_after=parse_retry_after(retry_after)
    )


def _ack(body: bytes) -> Ack:
    doc = msgspec.json.decode(body)
    return Ack(int(doc["accepted"]), int(doc["first_lsn"]), int(doc["last_lsn"]))


def _events_url(url: str) -> str:
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        base = "http://" + base
    return base if base.endswith(EVENTS_PATH) else base + EVENTS_PATH


class _RetryPolicy:
    __slots__ = ("connect_retries", "max_retries", "max_wait_s")

    def __init__(self, max_retries: int, max_wait_s: float, connect_retries: int) -> None:
        self.max_retries = max_retries
        self.max_wait_s = max_wait_s
        self.connect_retries = connect_retries

    def wait_s(self, exc: IngestError, attempt: int) -> float | None:
        """Seconds to wait before retry ``attempt`` (1-based), or None to give up."""
        limit = self.connect_retries if isinstance(exc, IngestConnectionError) else self.max_retries
        if not exc.retriable or attempt > limit:
            return None
        wait = exc.retry_after if exc.retry_after is not None else BACKOFF_S * 2 ** (attempt - 1)
        return min(wait, self.max_wait_s)


class IngestClient:
    """Asyncio producer client. Use ``async with IngestClient(url) as c: await c.send(...)``."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        max_wait_s: float = 30.0,
        connect_retries: int = 3,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        import aiohttp  # only the async client needs it

        self.url = _events_url(url)
        self._aiohttp = aiohttp
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._retry = _RetryPolicy(max_retries, max_wait_s, connect_retries)
        self._sleep = sleep
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> IngestClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, events: Iterable[Mapping[str, Any]]) -> Ack:
        """Post events as one atomic request."""
        return await self.send_ndjson(encode_events(events))

    async def send_ndjson(self, body: bytes) -> Ack:
        """Post an NDJSON body as one atomic request, retrying 429/503/507 as told."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._post(body)
            except IngestError as exc:
                wait = self._retry.wait_s(exc, attempt)
                if wait is None:
                    raise
            await self._sleep(wait)

    async def _post(self, body: bytes) -> Ack:
        aiohttp = self._aiohttp
        if self._session is None:
            connector = aiohttp.TCPConnector(keepalive_timeout=IDLE_REUSE_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        try:
            async with self._session.post(
                self.url, data=body, headers={"Content-Type": NDJSON}
            ) as resp:
                payload = await resp.read()
                if resp.status == 200:
                    return _ack(payload)
                raise error_from_response(resp.status, payload, resp.headers.get("Retry-After"))
        except aiohttp.ClientConnectorError as exc:
            raise IngestConnectionError(
                f"cannot connect to {self.url}: {exc}", maybe_sent=False
            ) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise IngestConnectionError(
                f"no answer from {self.url} ({type(exc).__name__}: {exc}); the request may "
                "or may not have been stored",
                maybe_sent=True,
            ) from exc


class SyncIngestClient:
    """Blocking producer client on one kept-alive connection (not thread-safe)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        max_wait_s: float = 30.0,
        connect_retries: int = 3,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        self.url = _events_url(url)
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._path = parts.path or EVENTS_PATH
        self._timeout_s = timeout_s
        self._retry = _RetryPolicy(max_retries, max_wait_s, connect_retries)
        self._sleep = sleep
        self._conn: http.client.HTTPConnection | None = None
        self._last_used = 0.0

    def __enter__(self) -> SyncIngestClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def send(self, events: Iterable[Mapping[str, Any]]) -> Ack:
        return self.send_ndjson(encode_events(events))

    def send_ndjson(self, body: bytes) -> Ack:
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._post(body)
            except IngestError as exc:
                wait = self._retry.wait_s(exc, attempt)
                if wait is None:
                    raise
            self._sleep(wait)

    def _connect(self) -> http.client.HTTPConnection:
        now = time.monotonic()
        if self._conn is not None and now - self._last_used > IDLE_REUSE_S:
            self.close()  # the daemon may have closed it: do not bet a request on it
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self._timeout_s)
            try:
                conn.connect()
            except OSError as exc:
                conn.close()
                raise IngestConnectionError(
                    f"cannot connect to {self.url}: {exc}", maybe_sent=False
                ) from exc
            self._conn = conn
        return self._conn

    def _post(self, body: bytes) -> Ack:
        conn = self._connect()
        try:
            conn.request("POST", self._path, body=body, headers={"Content-Type": NDJSON})
            resp = conn.getresponse()
            payload = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise IngestConnectionError(
                f"no answer from {self.url} ({type(exc).__name__}: {exc}); the request may "
                "or may not have been stored",
                maybe_sent=True,
            ) from exc
        self._last_used = time.monotonic()
        if resp.will_close:
            self.close()
        if resp.status == 200:
            return _ack(payload)
        raise error_from_response(resp.status, payload, resp.getheader("Retry-After"))
