"""A small producer client for the ingest API (``POST /v1/events``).

Two flavours with the same behaviour: :class:`IngestClient` (asyncio, aiohttp)
and :class:`SyncIngestClient` (blocking, standard library only; one kept-alive
``http.client`` connection, because ``urllib.request`` opens a new connection
per request).

- A call returns :class:`Ack` (``accepted``, ``first_lsn``, ``last_lsn``,
  ``replayed``) only when the daemon acknowledged the whole request as
  durable. ``replayed`` says the daemon answered a retry from the request's
  first attempt, which it had stored (docs/ingest.md, "Idempotent requests").
- Every request carries an ``Idempotency-Key``: the caller's (``key=``), or
  ``<key_prefix>-<n>``, a random prefix per client and the request's number.
  Every attempt of one request sends the same key, so a retry never stores the
  request twice while the daemon's de-duplication window holds the key.
- Retried with that key: connections that could not be opened, were reset or
  closed before the answer, attempts over ``timeout_s``, and 408, 429, 503
  and 507 (nothing stored). The wait is the server's ``Retry-After``, else an
  exponential backoff with jitter, each capped by ``max_wait_s``; no retry
  starts once ``retry_for_s`` (attempts and waits) would be exceeded.
- ``endpoints``: the daemons to try, in order (a primary and its standby,
  docs/operating.md, "A standby"). A connection error, a ``standby`` answer
  (503, :class:`StandbyError`) or a ``not_primary`` one (503,
  :class:`NotPrimaryError`: a primary whose manifest lapsed or was taken over)
  moves the request to the next endpoint at once,
  with the same key; once every endpoint failed in a row the ordinary wait
  comes first. Requests go to the endpoint that last answered.
- ``route="key"`` (default ``"order"``, the failover above): each event goes to
  the endpoint its (collection, key) picks by rendezvous hashing
  (:func:`key_endpoint`), so one key's events always reach one daemon. A
  request is split into one sub-request per endpoint, each key's events in
  their order, under the key ``<key>/<8 hex of the endpoint's URL>``; the
  sub-requests go at once, side by side, each retried at its own endpoint only
  (never another: that would break the key's order). The call returns
  :class:`RoutedAck`, one :class:`EndpointAck` per endpoint that got events.
- ``token``: sent as ``Authorization: Bearer`` (docs/security.md);
  ``ssl_context``: for an ``https://`` URL, e.g.
  ``daemon.security.client_context(ca_file, cert, key)`` for a private CA and
  a client certificate.
- Not retried: 400, 401, 403, 413, 415, 422 and any other answer, which raise a typed
  :class:`IngestError` carrying the HTTP status, the server's error word and
  message, and the full JSON body (a 422 has ``errors``: index, field, reason
  per problem).
- When the retries run out, the last error is raised, carrying ``key``,
  ``attempts``, ``elapsed_s`` and ``maybe_stored``: True when an attempt went
  out and got no answer, so the request may be durable. Resending it with the
  same key is safe within the window (``ingest.idempotency_window_s``,
  default 900 s, far above the default ``retry_for_s``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.utils
import hashlib
import http.client
import itertools
import random
import re
import secrets
import select
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    NamedTuple,
    Self,
    TypedDict,
    TypeVar,
    Unpack,
    cast,
    overload,
)

import msgspec

from daemon.errors import DaemonError

if TYPE_CHECKING:
    import ssl

NDJSON = "application/x-ndjson"
EVENTS_PATH = "/v1/events"
DEFAULT_URL = "http://127.0.0.1:8470"
# Reuse an idle connection only while it is surely open: the daemon closes
# idle connections after ingest.header_timeout_s (10 s by default).
IDLE_REUSE_S = 5.0
# Without a Retry-After header: exponential backoff from this, capped by max_wait_s;
# each wait is drawn between half and all of it, so producers that failed
# together (a daemon restart) do not come back together.
BACKOFF_S = 0.5
# The default retry budget per request: far below the daemon's de-duplication
# window (ingest.idempotency_window_s, 900 s), so every retry is recognised.
RETRY_FOR_S = 120.0
# The default time one attempt may take (connect, send, the answer).
TIMEOUT_S = 30.0
IDEMPOTENCY_KEY = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"
# The error word of a standby daemon's 503 (docs/ingest.md, "Clients and retries").
STANDBY = "standby"
# A primary that may not acknowledge now: its manifest lapsed or was taken over.
NOT_PRIMARY = "not_primary"
# Keys are 1..255 visible ASCII characters (ingest.max_idempotency_key_bytes); a
# prefix leaves room for the request number.
MAX_KEY_PREFIX = 200
# The daemon's default ingest.max_idempotency_key_bytes.
MAX_KEY = 255
# route="key": a sub-request's key is the request's, "/" and this many hex digits
# of its endpoint's events URL.
KEY_TAG_HEX = 8
ROUTES = ("order", "key")
Route = Literal["order", "key"]
_VISIBLE_ASCII = re.compile(r"[!-~]+")

_encode = msgspec.json.Encoder().encode


class Ack(NamedTuple):
    accepted: int
    first_lsn: int
    last_lsn: int
    # The daemon had stored this request already (an earlier attempt): these are
    # the LSNs it got then, and nothing was stored now.
    replayed: bool = False


class EndpointAck(NamedTuple):
    """``route="key"``: one endpoint's sub-request, acknowledged. Its LSNs are that
    daemon's own: they order the events of the keys routed to it, nothing else."""

    endpoint: str  # the events URL
    key: str  # the sub-request's Idempotency-Key
    accepted: int
    first_lsn: int
    last_lsn: int
    replayed: bool = False


class RoutedAck(NamedTuple):
    """``route="key"``: a request acknowledged at every endpoint it went to.
    ``acks`` has one entry per endpoint that got events, in the client's
    endpoint order."""

    acks: tuple[EndpointAck, ...]

    @property
    def accepted(self) -> int:
        return sum(a.accepted for a in self.acks)


class Retry(NamedTuple):
    """What ``on_retry`` is told before each wait."""

    key: str
    attempt: int  # the attempt that failed (1-based)
    error: IngestError
    wait_s: float
    elapsed_s: float  # since the first attempt began
    endpoint: str = ""  # where the next attempt goes (another one after a failover)


class IngestError(DaemonError):
    """The ingest API refused a request (``status`` set) or could not be reached."""

    retriable: bool | None = False  # subclasses that a retry may cure say True
    # Subclasses that another endpoint may cure at once say True: the request
    # moves to the client's next endpoint without a wait.
    fails_over = False

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
        # Set by the client once it stops retrying the request.
        self.key: str | None = None
        self.attempts = 1
        self.elapsed_s = 0.0
        # An attempt went out and got no answer: the request may be durable.
        self.maybe_stored = False
        # The error was retriable, but the retry budget ran out.
        self.gave_up = False
        # route="key": the endpoint whose sub-request failed, and the sub-requests of
        # the same request that other endpoints acknowledged.
        self.endpoint: str | None = None
        self.acked: tuple[EndpointAck, ...] = ()


class BadRequestError(IngestError):
    """400: the body is not valid NDJSON/JSON (``body`` has line, column, position)."""


class UnauthorizedError(IngestError):
    """401: no producer token, or one the daemon does not know; nothing was stored."""


class ForbiddenError(IngestError):
    """403: the token may not write a collection of the request (``body["collection"]``);
    nothing was stored."""


class PayloadTooLargeError(IngestError):
    """413: the body, an event or the event count is over the daemon's limit."""


class UnsupportedMediaTypeError(IngestError):
    """415: wrong Content-Type."""


class RequestTimeoutError(IngestError):
    """408: the body did not arrive within the daemon's deadline; nothing was stored."""

    retriable = True


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


class StandbyError(UnavailableError):
    """503 ``standby``: this daemon is a standby and acknowledges nothing; nothing
    was stored. ``primary`` is the host of the archive's current holder (None:
    none holds it). A client with other endpoints tries the next one at once."""

    fails_over = True

    @property
    def primary(self) -> str | None:
        got = self.body.get("primary")
        return got if isinstance(got, str) else None


class NotPrimaryError(UnavailableError):
    """503 ``not_primary``: this daemon was the archive's primary but has not
    renewed its manifest in time, or was taken over; nothing was acknowledged.
    A client with other endpoints tries the next one at once."""

    fails_over = True


class InsufficientStorageError(IngestError):
    """507: the WAL's volume is full; nothing was stored; retry after ``retry_after``."""

    retriable = True


class UnroutableError(IngestError):
    """``route="key"``: a line of the request has no collection or key to route it by
    (``line``: 1-based, ``index``: the event's 0-based index); nothing was sent."""

    def __init__(
        self,
        message: str,
        *,
        line: int | None = None,
        index: int | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message, body={"line": line, "index": index})
        self.line = line
        self.index = index
        self.reason = reason  # why the line has no collection and key (the decoder's words)


class IngestConnectionError(IngestError):
    """No HTTP answer. ``maybe_sent`` says whether this attempt may have arrived.

    Retriable either way: the request's ``Idempotency-Key`` makes a retry of a
    request that did arrive store nothing.
    """

    retriable = True
    fails_over = True

    def __init__(self, message: str, *, maybe_sent: bool) -> None:
        super().__init__(message)
        self.maybe_sent = maybe_sent


_BY_STATUS: dict[int, type[IngestError]] = {
    400: BadRequestError,
    401: UnauthorizedError,
    403: ForbiddenError,
    408: RequestTimeoutError,
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
    if status == 503 and error == STANDBY:
        cls = StandbyError
    elif status == 503 and error == NOT_PRIMARY:
        cls = NotPrimaryError
    return cls(
        message, status=status, error=error, body=doc, retry_after=parse_retry_after(retry_after)
    )


def _ack(body: bytes, replayed_header: str | None) -> Ack:
    doc = msgspec.json.decode(body)
    replayed = doc.get("replayed") is True or (replayed_header or "").lower() == "true"
    return Ack(int(doc["accepted"]), int(doc["first_lsn"]), int(doc["last_lsn"]), replayed)


def new_key_prefix(kind: str = "ep") -> str:
    """A random key prefix: unique per client (64 random bits), e.g. ``ep-1f0c9a7e2b4d6c8a``."""
    return f"{kind}-{secrets.token_hex(8)}"


def check_key_prefix(prefix: str) -> str:
    if not (0 < len(prefix) <= MAX_KEY_PREFIX and _VISIBLE_ASCII.fullmatch(prefix)):
        raise ValueError(
            f"an Idempotency-Key prefix is 1 to {MAX_KEY_PREFIX} visible ASCII characters "
            f"(! to ~), got {prefix!r}"
        )
    return prefix


def _events_url(url: str) -> str:
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        base = "http://" + base
    return base if base.endswith(EVENTS_PATH) else base + EVENTS_PATH


def _endpoint_urls(url: str | None, endpoints: Sequence[str] | None) -> tuple[str, ...]:
    """The events URL of each endpoint, in order: ``endpoints``, else ``url``."""
    if endpoints is None:
        return (_events_url(DEFAULT_URL if url is None else url),)
    if isinstance(endpoints, str):
        raise TypeError("endpoints is a list of URLs, not one URL (use url= for one)")
    if url is not None:
        raise ValueError("give url or endpoints, not both")
    if not endpoints:
        raise ValueError("endpoints needs at least one URL")
    return tuple(_events_url(u) for u in endpoints)


def route_weight(collection: str, key: str, url: str) -> int:
    """The rendezvous weight of ``url`` for (collection, key): 64 bits of BLAKE2b
    of ``collection\0key\0url``, the same in every process and run."""
    data = f"{collection}\0{key}\0{url}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def pick_endpoint(collection: str, key: str, urls: Sequence[str]) -> int:
    """The index of the URL with the highest weight for (collection, key): adding a
    URL moves only the keys it now wins (about 1/N), removing one only its own."""
    return max(range(len(urls)), key=lambda i: (route_weight(collection, key, urls[i]), urls[i]))


def key_endpoint(collection: str, key: str, endpoints: Sequence[str]) -> str:
    """The events URL that ``route="key"`` sends (collection, key) to."""
    urls = _endpoint_urls(None, endpoints)
    return urls[pick_endpoint(collection, key, urls)]


def sub_key(key: str, url: str) -> str:
    """``route="key"``: the Idempotency-Key of a request's sub-request to ``url``."""
    tag = hashlib.blake2b(url.encode(), digest_size=KEY_TAG_HEX // 2).hexdigest()
    return f"{key}/{tag}"


class _Routing(msgspec.Struct):
    collection: str
    key: str


_decode_routing = msgspec.json.Decoder(_Routing).decode


class _Part:
    """One endpoint's sub-request: its lines, and each one's line number and
    event index in the whole request (to translate the daemon's answers back)."""

    __slots__ = ("indices", "linenos", "lines")

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.linenos: list[int] = []
        self.indices: list[int] = []

    @property
    def body(self) -> bytes:
        return b"".join(self.lines)

    def remap(self, exc: IngestError) -> None:
        """Line numbers and event indices in ``exc.body`` as the whole request's."""
        body = dict(exc.body)
        body["line"] = self._at(body.get("line"), self.linenos, 1)
        if body["line"] is None:
            del body["line"]
        errors = body.get("errors")
        if isinstance(errors, list):
            remapped: list[Any] = []
            for item in errors:
                if isinstance(item, dict):
                    item = dict(item)
                    for field, table, base in (
                        ("line", self.linenos, 1),
                        ("index", self.indices, 0),
                    ):
                        if field in item:
                            item[field] = self._at(item[field], table, base)
                remapped.append(item)
            body["errors"] = remapped
        exc.body = body

    @staticmethod
    def _at(value: Any, table: list[int], base: int) -> Any:
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and 0 <= value - base < len(table)
        ):
            return table[value - base]
        return value


def split_by_key(body: bytes, urls: Sequence[str]) -> dict[int, _Part]:
    """``route="key"``: the body's events by endpoint index, each key's in order."""
    parts: dict[int, _Part] = {}
    index = 0
    for lineno, line in enumerate(body.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            event = _decode_routing(line)
        except msgspec.MsgspecError as exc:
            raise UnroutableError(
                f'route "key" sends each event by its collection and key, and line {lineno} '
                f"(event {index}) has none to route by: {exc}; nothing was sent",
                line=lineno,
                index=index,
                reason=str(exc),
            ) from None
        at = pick_endpoint(event.collection, event.key, urls)
        part = parts.get(at)
        if part is None:
            part = parts[at] = _Part()
        part.lines.append(line + b"\n")
        part.linenos.append(lineno)
        part.indices.append(index)
        index += 1
    if not parts:
        raise UnroutableError("the request holds no events; nothing was sent")
    return dict(sorted(parts.items()))


def _routed_key(key: str) -> str:
    if len(key) + 1 + KEY_TAG_HEX > MAX_KEY:
        raise ValueError(
            f'route "key" sends a request under "<key>/<{KEY_TAG_HEX} hex digits>": a key '
            f"is at most {MAX_KEY - 1 - KEY_TAG_HEX} characters, got {len(key)}"
        )
    return key


def _merge(
    key: str, urls: Sequence[str], parts: dict[int, _Part], results: Sequence[object]
) -> RoutedAck:
    """The acks of a request's sub-requests; else raises the first failure (in
    endpoint order), carrying the acks of the others (``acked``)."""
    acks: list[EndpointAck] = []
    errors: list[IngestError] = []
    for (at, part), result in zip(parts.items(), results, strict=True):
        if isinstance(result, IngestError):
            part.remap(result)
            result.endpoint = urls[at]
            errors.append(result)
        elif isinstance(result, BaseException):
            raise result
        else:
            ack = cast(Ack, result)
            acks.append(EndpointAck(urls[at], sub_key(key, urls[at]), *ack))
    if not errors:
        return RoutedAck(tuple(acks))
    first = errors[0]
    first.acked = tuple(acks)
    first.key = key
    first.maybe_stored = any(e.maybe_stored for e in errors)
    others = [f"{e.endpoint}: {e.message}" for e in errors[1:]]
    if others:
        first.args = (f"{first.args[0]} (also failed: {'; '.join(others)})",)
    raise first


class _Endpoints:
    """A client's endpoints in order, and the one its requests go to now: the
    last that answered, so after a failover requests stay on the new one."""

    __slots__ = ("current", "urls")

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = urls
        self.current = 0

    def __len__(self) -> int:
        return len(self.urls)

    @property
    def url(self) -> str:
        return self.urls[self.current]


class _RetryPolicy:
    __slots__ = ("max_retries", "max_wait_s", "on_retry", "retry_for_s")

    def __init__(
        self,
        retry_for_s: float,
        max_retries: int | None,
        max_wait_s: float,
        on_retry: Callable[[Retry], Any] | None,
    ) -> None:
        if retry_for_s < 0:
            raise ValueError(f"retry_for_s must be >= 0, got {retry_for_s}")
        self.retry_for_s = retry_for_s
        self.max_retries = max_retries
        self.max_wait_s = max_wait_s
        self.on_retry = on_retry


class _Attempts:
    """The attempts of one request: whether and when to retry, where, what to tell at the end.

    An error that another endpoint may cure (``fails_over``) moves the request to
    the next endpoint at once, until each endpoint has failed once in a row (a
    *round*); then, and after any other retriable error, the policy's wait
    comes first. ``max_retries`` and ``retry_for_s`` bound the waits, so each
    round tries every endpoint. Time is counted as the attempts took plus the
    waits asked for, so an injected ``sleep`` that does not sleep still spends
    the budget.
    """

    __slots__ = (
        "at",
        "backoffs",
        "count",
        "endpoints",
        "in_round",
        "key",
        "name_endpoint",
        "policy",
        "retries",
        "spent",
        "unanswered_at",
    )

    def __init__(
        self, policy: _RetryPolicy, key: str, endpoints: _Endpoints, name_endpoint: bool = False
    ) -> None:
        self.policy = policy
        self.key = key
        self.endpoints = endpoints
        self.name_endpoint = name_endpoint  # the message says where the last attempt went
        # The endpoint of this request's next attempt; the client's current one
        # moves with it (the request fails over) unless another request moved it.
        self.at = endpoints.current
        self.count = 0
        self.retries = 0  # retries after a wait
        self.in_round = 0  # endpoints that failed over in a row
        self.backoffs = 0
        self.spent = 0.0
        self.unanswered_at: set[int] = set()  # endpoints where an attempt got no answer

    def failed(self, exc: IngestError, took_s: float) -> float | None:
        """Seconds to wait before the next attempt (at ``endpoints.url``), or None:
        then ``exc`` is annotated and the caller raises it."""
        p = self.policy
        self.spent += took_s
        if isinstance(exc, IngestConnectionError) and exc.maybe_sent:
            self.unanswered_at.add(self.at)
        endpoints = self.endpoints
        if exc.fails_over and len(endpoints) > 1:
            failed, self.at = self.at, (self.at + 1) % len(endpoints)
            if endpoints.current == failed:
                endpoints.current = self.at
            self.in_round += 1
            if self.in_round < len(endpoints):
                if p.on_retry is not None:
                    p.on_retry(Retry(self.key, self.count, exc, 0.0, self.spent, self.url))
                return 0.0
        else:
            endpoints.current = self.at  # it answered: the next requests start there
        self.in_round = 0
        wait = None
        if exc.retriable and (p.max_retries is None or self.retries < p.max_retries):
            if exc.retry_after is not None:
                wait = min(exc.retry_after, p.max_wait_s)
            else:
                ceiling = min(BACKOFF_S * 2**self.backoffs, p.max_wait_s)
                self.backoffs += 1
                wait = ceiling * (0.5 + 0.5 * random.random())
            if self.spent + wait > p.retry_for_s:
                wait = None
        if wait is None:
            self._annotate(exc)
            return None
        self.retries += 1
        if p.on_retry is not None:
            p.on_retry(Retry(self.key, self.count, exc, wait, self.spent, self.url))
        self.spent += wait
        return wait

    @property
    def url(self) -> str:
        """The events URL of the next attempt."""
        return self.endpoints.urls[self.at]

    def succeeded(self) -> None:
        self.endpoints.current = self.at

    @property
    def failing_over(self) -> bool:
        """The next attempt goes to the next endpoint at once, without a wait."""
        return self.in_round > 0

    def _annotate(self, exc: IngestError) -> None:
        exc.key = self.key
        exc.endpoint = self.url
        exc.attempts = self.count
        exc.elapsed_s = self.spent
        # A definite refusal settles an earlier attempt at the same endpoint that
        # got no answer: its checks give the same answer for the same body, and
        # a stored request would have been answered from the window (a 200
        # replay) instead. Another endpoint's refusal settles nothing there.
        exc.maybe_stored = bool(self.unanswered_at) and (
            bool(exc.retriable) or bool(self.unanswered_at - {self.at})
        )
        exc.gave_up = bool(exc.retriable)
        if not exc.gave_up:
            return
        note = f"gave up after {self.count} attempts in {self.spent:.1f} s"
        if len(self.endpoints) > 1:
            note += f" at {len(self.endpoints)} endpoints"
        elif self.name_endpoint:
            note += f" at {self.url}"
        if exc.maybe_stored:
            note += (
                f"; an attempt got no answer, so the request may have been stored: "
                f"resending it with {IDEMPOTENCY_KEY} {self.key!r} is safe within the "
                "daemon's de-duplication window (ingest.idempotency_window_s)"
            )
        else:
            note += "; nothing of the request was stored"
        exc.args = (f"{exc.message} ({note})",)


# What a send returns: Ack (route "order") or RoutedAck (route "key").
R = TypeVar("R", bound=Ack | RoutedAck)


class ClientOptions(TypedDict, total=False):
    """The constructor arguments both clients share, past ``url``, ``endpoints`` and ``route``."""

    timeout_s: float
    retry_for_s: float
    max_retries: int | None
    max_wait_s: float
    key_prefix: str | None
    on_retry: Callable[[Retry], Any] | None
    sleep: Callable[[float], Any]
    token: str | None
    ssl_context: ssl.SSLContext | None


def _check_route(route: str, urls: tuple[str, ...]) -> bool:
    """Whether ``route`` is "key" (else "order")."""
    if route not in ROUTES:
        raise ValueError(f"route is one of {', '.join(map(repr, ROUTES))}, got {route!r}")
    if route == "key" and len(set(urls)) != len(urls):
        raise ValueError(f'route "key" needs distinct endpoints, got {list(urls)}')
    return route == "key"


class IngestClient(Generic[R]):
    """Asyncio producer client. Use ``async with IngestClient(url) as c: await c.send(...)``.

    ``endpoints`` (instead of ``url``): the daemons to try in order, failing over
    on connection errors and standby answers (module doc). ``timeout_s`` bounds
    one attempt; ``retry_for_s`` the attempts and waits of one request (0: no
    retry, but each endpoint is tried once); ``max_retries``, when set, the
    number of retries after a wait too; ``max_wait_s`` each wait. ``key_prefix``
    names this client's requests (default random); ``on_retry`` is called
    before each wait and each failover (``wait_s`` 0, ``endpoint`` the next).
    ``route="key"``: each event to the endpoint its collection and key pick; a
    send returns :class:`RoutedAck` (module doc); ``on_retry`` sees each
    sub-request's own key, and ``url`` is the first endpoint's.
    """

    @overload
    def __init__(
        self: IngestClient[Ack],
        url: str | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        route: Literal["order"] = "order",
        **options: Unpack[ClientOptions],
    ) -> None: ...

    @overload
    def __init__(
        self: IngestClient[RoutedAck],
        url: str | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        route: Literal["key"],
        **options: Unpack[ClientOptions],
    ) -> None: ...

    def __init__(
        self,
        url: str | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        route: Route = "order",
        timeout_s: float = TIMEOUT_S,
        retry_for_s: float = RETRY_FOR_S,
        max_retries: int | None = None,
        max_wait_s: float = 30.0,
        key_prefix: str | None = None,
        on_retry: Callable[[Retry], Any] | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        import aiohttp  # only the async client needs it

        self._endpoints = _Endpoints(_endpoint_urls(url, endpoints))
        self.route: Route = route
        self._name_endpoint = False
        # route="key": one single-endpoint client per endpoint, which retries there only.
        self._routes: tuple[IngestClient[Ack], ...] | None = None
        if _check_route(route, self._endpoints.urls):
            self._routes = tuple(
                IngestClient(
                    u,
                    timeout_s=timeout_s,
                    retry_for_s=retry_for_s,
                    max_retries=max_retries,
                    max_wait_s=max_wait_s,
                    key_prefix=key_prefix,
                    on_retry=on_retry,
                    sleep=sleep,
                    token=token,
                    ssl_context=ssl_context,
                )
                for u in self._endpoints.urls
            )
            for child in self._routes:
                child._name_endpoint = True
        self._headers = _auth_headers(token)
        self._ssl: ssl.SSLContext | bool = True if ssl_context is None else ssl_context
        self.key_prefix = check_key_prefix(key_prefix or new_key_prefix())
        self._numbers = itertools.count(1)
        self._aiohttp = aiohttp
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._retry = _RetryPolicy(retry_for_s, max_retries, max_wait_s, on_retry)
        self._sleep = sleep
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        """The events URL requests go to now (after a failover, the new endpoint's)."""
        return self._endpoints.url

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._endpoints.urls

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for child in self._routes or ():
            await child.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def next_key(self) -> str:
        """The key of this client's next request: ``<key_prefix>-<n>``."""
        return f"{self.key_prefix}-{next(self._numbers)}"

    async def send(self, events: Iterable[Mapping[str, Any]], *, key: str | None = None) -> R:
        """Post events as one atomic request (``route="key"``: one per endpoint)."""
        return await self.send_ndjson(encode_events(events), key=key)

    async def send_ndjson(self, body: bytes, *, key: str | None = None) -> R:
        """Post an NDJSON body as one atomic request; every attempt carries ``key``
        (default :meth:`next_key`). ``route="key"``: one sub-request per endpoint,
        side by side; :class:`RoutedAck` once every one is acknowledged."""
        if self._routes is None:
            return cast(R, await self._send_one(body, key))
        key = _routed_key(key or self.next_key())
        urls = self._endpoints.urls
        parts = split_by_key(body, urls)
        results = await asyncio.gather(
            *(
                self._routes[at].send_ndjson(part.body, key=sub_key(key, urls[at]))
                for at, part in parts.items()
            ),
            return_exceptions=True,
        )
        return cast(R, _merge(key, urls, parts, results))

    async def _send_one(self, body: bytes, key: str | None) -> Ack:
        attempts = _Attempts(
            self._retry, key or self.next_key(), self._endpoints, self._name_endpoint
        )
        loop = asyncio.get_running_loop()
        while True:
            attempts.count += 1
            began = loop.time()
            try:
                ack = await self._post(body, attempts.key, attempts.url)
            except IngestError as exc:
                wait = attempts.failed(exc, loop.time() - began)
                if wait is None:
                    raise
            else:
                attempts.succeeded()
                return ack
            if not attempts.failing_over:
                await self._sleep(wait)

    async def _post(self, body: bytes, key: str, url: str) -> Ack:
        aiohttp = self._aiohttp
        if self._session is None:
            connector = aiohttp.TCPConnector(keepalive_timeout=IDLE_REUSE_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        headers = {"Content-Type": NDJSON, IDEMPOTENCY_KEY: key, **self._headers}
        try:
            async with self._session.post(url, data=body, headers=headers, ssl=self._ssl) as resp:
                payload = await resp.read()
                if resp.status == 200:
                    return _ack(payload, resp.headers.get(REPLAYED))
                raise error_from_response(resp.status, payload, resp.headers.get("Retry-After"))
        except aiohttp.ClientConnectorError as exc:
            raise IngestConnectionError(
                f"cannot connect to {url}: {exc}", maybe_sent=False
            ) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise IngestConnectionError(
                f"no answer from {url} ({type(exc).__name__}: {exc}); the request may "
                "or may not have been stored",
                maybe_sent=True,
            ) from exc


class SyncIngestClient(Generic[R]):
    """Blocking producer client on one kept-alive connection (not thread-safe).

    The same parameters as :class:`IngestClient`; ``timeout_s`` bounds each
    socket operation of an attempt (connect, send, each read). ``route="key"``:
    a connection per endpoint, and the sub-requests of a request go side by
    side on threads of the client's own (``on_retry`` and ``sleep`` are called
    on them).
    """

    @overload
    def __init__(
        self: SyncIngestClient[Ack],
        url: str | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        route: Literal["order"] = "order",
        **options: Unpack[ClientOptions],
    ) -> None: ...

    @overload
    def __init__(
        self: SyncIngestClient[RoutedAck],
        url: str | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        route: Literal["key"],
        **options: Unpack[ClientOptions],
    ) -> None: ...

    def __init__(
        self,
        url: str | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        route: Route = "order",
        timeout_s: float = TIMEOUT_S,
        retry_for_s: float = RETRY_FOR_S,
        max_retries: int | None = None,
        max_wait_s: float = 30.0,
        key_prefix: str | None = None,
        on_retry: Callable[[Retry], Any] | None = None,
        sleep: Callable[[float], Any] = time.sleep,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._endpoints = _Endpoints(_endpoint_urls(url, endpoints))
        self.route: Route = route
        self._name_endpoint = False
        self._routes: tuple[SyncIngestClient[Ack], ...] | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if _check_route(route, self._endpoints.urls):
            self._routes = tuple(
                SyncIngestClient(
                    u,
                    timeout_s=timeout_s,
                    retry_for_s=retry_for_s,
                    max_retries=max_retries,
                    max_wait_s=max_wait_s,
                    key_prefix=key_prefix,
                    on_retry=on_retry,
                    sleep=sleep,
                    token=token,
                    ssl_context=ssl_context,
                )
                for u in self._endpoints.urls
            )
            for child in self._routes:
                child._name_endpoint = True
        self._headers = _auth_headers(token)
        self._ssl = ssl_context
        # Per endpoint: (https, host, port, path).
        self._targets: list[tuple[bool, str, int, str]] = []
        for events_url in self._endpoints.urls:
            parts = urllib.parse.urlsplit(events_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {events_url!r}")
            https = parts.scheme == "https"
            port = parts.port or (443 if https else 80)
            self._targets.append((https, parts.hostname, port, parts.path or EVENTS_PATH))
        self._conn_to = 0  # the endpoint self._conn is connected to
        self._timeout_s = timeout_s
        self.key_prefix = check_key_prefix(key_prefix or new_key_prefix())
        self._numbers = itertools.count(1)
        self._retry = _RetryPolicy(retry_for_s, max_retries, max_wait_s, on_retry)
        self._sleep = sleep
        self._conn: http.client.HTTPConnection | None = None
        self._last_used = 0.0

    @property
    def url(self) -> str:
        """The events URL requests go to now (after a failover, the new endpoint's)."""
        return self._endpoints.url

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._endpoints.urls

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for child in self._routes or ():
            child.close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def next_key(self) -> str:
        """The key of this client's next request: ``<key_prefix>-<n>``."""
        return f"{self.key_prefix}-{next(self._numbers)}"

    def send(self, events: Iterable[Mapping[str, Any]], *, key: str | None = None) -> R:
        return self.send_ndjson(encode_events(events), key=key)

    def send_ndjson(self, body: bytes, *, key: str | None = None) -> R:
        if self._routes is None:
            return cast(R, self._send_one(body, key))
        key = _routed_key(key or self.next_key())
        urls = self._endpoints.urls
        parts = split_by_key(body, urls)
        routes = self._routes

        def one(at: int, part: _Part) -> object:
            try:
                return routes[at].send_ndjson(part.body, key=sub_key(key, urls[at]))
            except IngestError as exc:
                return exc

        if len(parts) == 1:
            results = [one(*next(iter(parts.items())))]
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    len(urls), thread_name_prefix="eventplane-route"
                )
            futures = [self._pool.submit(one, at, part) for at, part in parts.items()]
            results = [f.result() for f in futures]
        return cast(R, _merge(key, urls, parts, results))

    def _send_one(self, body: bytes, key: str | None) -> Ack:
        attempts = _Attempts(
            self._retry, key or self.next_key(), self._endpoints, self._name_endpoint
        )
        while True:
            attempts.count += 1
            began = time.monotonic()
            try:
                ack = self._post(body, attempts.key, attempts.at)
            except IngestError as exc:
                wait = attempts.failed(exc, time.monotonic() - began)
                if wait is None:
                    raise
            else:
                attempts.succeeded()
                return ack
            if not attempts.failing_over:
                self._sleep(wait)

    def _connect(self, current: int) -> http.client.HTTPConnection:
        now = time.monotonic()
        if self._conn is not None and (
            self._conn_to != current
            or now - self._last_used > IDLE_REUSE_S
            or _closed_by_peer(self._conn)
        ):
            self.close()  # the daemon may have closed it: do not bet a request on it
        if self._conn is None:
            https, host, port, _ = self._targets[current]
            conn: http.client.HTTPConnection
            if https:
                conn = http.client.HTTPSConnection(
                    host, port, timeout=self._timeout_s, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=self._timeout_s)
            try:
                conn.connect()
            except OSError as exc:
                conn.close()
                raise IngestConnectionError(
                    f"cannot connect to {self._endpoints.urls[current]}: {exc}", maybe_sent=False
                ) from exc
            self._conn = conn
            self._conn_to = current
        return self._conn

    def _post(self, body: bytes, key: str, at: int) -> Ack:
        url = self._endpoints.urls[at]
        conn = self._connect(at)
        headers = {"Content-Type": NDJSON, IDEMPOTENCY_KEY: key, **self._headers}
        try:
            conn.request("POST", self._targets[at][3], body=body, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise IngestConnectionError(
                f"no answer from {url} ({type(exc).__name__}: {exc}); the request may "
                "or may not have been stored",
                maybe_sent=True,
            ) from exc
        self._last_used = time.monotonic()
        if resp.will_close:
            self.close()
        if resp.status == 200:
            return _ack(payload, resp.getheader(REPLAYED))
        raise error_from_response(resp.status, payload, resp.getheader("Retry-After"))


# The producer client by the name the failover docs use (docs/ingest.md, "Clients and retries"):
# ``Client(endpoints=[primary, standby])``.
Client = IngestClient


def _auth_headers(token: str | None) -> dict[str, str]:
    if token is None:
        return {}
    if not token or any(c in token for c in "\r\n"):
        raise ValueError("a producer token is one line of visible characters")
    return {"Authorization": f"Bearer {token}"}


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept-alive connection became readable: the daemon closed it
    (or sent something unasked). Either way it must not carry the next request."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
