"""HTTP ingest: ``POST /v1/events`` → validate whole → one WAL append → ack.

A request is atomic: its events go to the WAL in one ``append`` (one frame,
consecutive LSNs in request order) and the 200 is sent only after the group
commit's fdatasync covered them (invariant 1); a rejected request leaves the
WAL untouched. The steps, marked in :meth:`IngestServer._post_events`:

1. Admission before a byte of body (``_admit``): a standby (503 ``standby``),
   draining (503), producer and
   quota (401, 429; :mod:`daemon.ingest.producers`), lag (429), content type
   and coding (415), ``Content-Length`` (413).
2. Read the body under its deadline and the memory budget (408, 413;
   :mod:`daemon.ingest.coding`, :mod:`daemon.ingest.listener`).
3. With an ``Idempotency-Key``, a replay is answered from the first append
   (:mod:`daemon.ingest.idempotency`); else parse and validate whole, the
   producer's scope included (400, 403, 413, 422; :mod:`daemon.ingest.validate`,
   :mod:`daemon.ingest.payload`), then charge its quota (429).
4. Shard and encode each event (:class:`daemon.events.StoredEvent`; 413 for an
   event over ``max_event_bytes``).
5. One ``wal.append`` for all events, carrying the key (507 volume full, 503
   WAL failed or closed).
6. 200 ``{"accepted": n, "first_lsn": a, "last_lsn": b}``.

Slow and many clients, draining, and every status code: docs/ingest.md.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol
from zlib import crc32

import structlog
from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from daemon.config import CdcMirror, Config, ProducerToken
from daemon.errors import ArchiveUnavailable, DaemonError
from daemon.ingest.coding import BodyDecoder, CodingError, content_coding
from daemon.ingest.idempotency import (
    REPLAYED,
    Idempotency,
    request_digest,
    scoped_key,
)
from daemon.ingest.listener import ByteBudget, _CappedSite, _idle, _Refuse, name_server
from daemon.ingest.payload import min_length, problem
from daemon.ingest.producers import Producers
from daemon.ingest.quota import Quotas
from daemon.ingest.validate import (
    _LBRACE,
    DECODE_ERRORS,
    InEvent,
    Rejection,
    _decode_many,
    _decode_one,
    _disagreement,
    _json,
    _msgpack_encode,
    event_time_us,
    explain_body,
)
from daemon.metrics import Metrics
from daemon.security import ProducerAuth, ServerTls
from daemon.shard import collection_seed
from daemon.table.mirror import check_new, parse_doc
from wal.errors import WalClosedError, WalFatalError, WalFullError
from wal.format import CoreSections, EncodedSection, RequestEntry, RequestTag

log = structlog.get_logger("eventplane.ingest")

PATH = "/v1/events"
NDJSON_TYPES = frozenset({"application/x-ndjson", "application/ndjson", "application/jsonl"})
JSON_TYPES = frozenset({"application/json"})
# After an early answer (413, 408, 429, ...) aiohttp keeps reading and discarding
# the unread body this long, so the client sees the answer instead of a reset.
LINGER_S = 2.0
# How often a drain looks at its connections (IngestServer.stop).
DRAIN_POLL_S = 0.02
# The answer's "ack" field under [wal.archive]: which mode acknowledged the request.
_ACK_FIELD = {False: b',"ack":"local"', True: b',"ack":"archived"'}


class WalAppender(Protocol):
    """The slice of :class:`wal.Wal` that ingest needs."""

    async def append(
        self, items: Sequence[tuple[int, bytes]], request: RequestTag | None = None
    ) -> tuple[int, int]: ...

    def find_request(self, key: bytes) -> RequestEntry | None: ...


class ArchiveGate(Protocol):
    """The slice of :class:`daemon.walarchive.WalArchive` that ingest needs."""

    acks_archived: bool

    def refusal(self) -> str | None: ...

    def lease_refusal(self) -> str | None: ...

    async def until_archived(self, lsn: int) -> None: ...


class IngestServer(Producers, Idempotency):
    """The ingest listener. ``start()`` binds ``ingest.listen`` (port 0 picks one)."""

    def __init__(
        self,
        cfg: Config,
        wal: WalAppender,
        metrics: Metrics,
        lag: Callable[[], int],
        *,
        tokens: tuple[ProducerToken, ...] | None = None,
        tls: ServerTls | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = cfg.ingest
        self._cores = cfg.daemon.cores
        # Producers (docs/security.md): the daemon passes the inline entries and the
        # tokens file's (daemon.security.load_tokens); none: ingest is open.
        self._auth = ProducerAuth(cfg.ingest.tokens if tokens is None else tokens)
        self._quotas = Quotas(clock)
        self._quotas.configure(self._auth.tokens)
        if tls is None and cfg.ingest.tls.enabled:
            tls = ServerTls(cfg.ingest.tls, "ingest")
        self.tls = tls
        self._wal: WalAppender = wal
        self._metrics = metrics
        self._lag = lag
        c = self._cfg
        self._max_body = c.max_body_bytes
        self._max_event = c.max_event_bytes
        self._max_events = c.max_events_per_request
        self._max_event_id = c.max_event_id_chars
        self._max_depth = c.max_json_depth
        # Strict mirrors' typed columns, by collection (docs/cdc.md, "Mirror tables").
        self._strict: dict[str, list[CdcMirror]] = {}
        for m in cfg.cdc.mirrors:
            if m.strict and m.columns:
                self._strict.setdefault(m.collection, []).append(m)
        # Payloads shorter than this cannot break a CDC writer's limit (min_length).
        self._check_from = min_length(c.max_json_depth)
        # Bodies being read or parsed hold at most max_buffered_bytes; parsed
        # events and payloads add about 2x on top, so ingest stays within ~3x.
        self._budget = ByteBudget(c.max_buffered_bytes)
        # _encode's per-core lists (event loop only; empty between requests).
        self._positions: list[list[int]] = [[] for _ in range(self._cores)]
        self._payloads: list[list[bytes]] = [[] for _ in range(self._cores)]
        self._draining = False
        self._hurry = False
        self._wal_errors_logged: set[type[Exception]] = set()
        # While the WAL's volume is full: (Unix time of the first 507, bytes the
        # last refused append needed, the error); None once an append fits.
        self.wal_full: tuple[float, int, str] | None = None
        self._refusing = 0
        # [wal.archive] (set by the daemon): 503 while it refuses; with ack =
        # "archived" the 2xx waits until the request's events are archived.
        self.archive: ArchiveGate | None = None
        # [wal.archive] role = "standby" (set by the daemon): every request is
        # answered 503 "standby" naming the primary's host (the call's answer,
        # None when no daemon holds the archive); nothing is stored.
        self.standby: Callable[[], str | None] | None = None
        self._runner: web.AppRunner | None = None
        self._site: _CappedSite | None = None
        self._seeds: dict[str, int] = {}
        # Keyed requests being stored: key -> (digest, their outcome: LSNs, or
        # None when nothing was stored). A retry of the same key waits on it.
        self._in_flight: dict[bytes, tuple[bytes, asyncio.Future[tuple[int, int] | None]]] = {}
        self._max_key = c.max_idempotency_key_bytes
        # Children resolved once: a labelled lookup per request is measurable.
        self._m_requests: dict[int, Any] = {}
        self._m_ok = self._requests_counter(200)
        self._m_events = metrics.ingest_events
        self._m_bytes = metrics.ingest_bytes
        self._m_latency = metrics.ingest_ack_latency
        self._m_replays = metrics.ingest_replays
        retry = c.retry_after_s
        over_cap = _json(
            {
                "error": "over_capacity",
                "message": f"ingest already has {c.max_connections} open connections "
                f"(ingest.max_connections); retry in {retry} s",
            }
        )
        self._over_capacity_response = (
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n"
            b"Retry-After: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (len(over_cap), retry, over_cap)
        )

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(client_max_size=self._max_body)
        app.on_response_prepare.append(name_server)
        app.router.add_post(PATH, self._post_events, expect_handler=self._expect)
        app.router.add_route("*", PATH, self._wrong_method)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        runner = web.AppRunner(
            app,
            access_log=None,
            # The idle keep-alive timer is aiohttp's only clock on a connection
            # that has not sent a full request head: it is the header deadline.
            keepalive_timeout=self._cfg.header_timeout_s,
            lingering_time=LINGER_S,
            # Ingest undoes Content-Encoding itself (daemon.ingest.coding says why).
            auto_decompress=False,
        )
        await runner.setup()
        server = runner.server
        if server is None:  # aiohttp sets it in setup(); a None here is an aiohttp change
            raise DaemonError("ingest: aiohttp's AppRunner.setup() left no server")
        self._runner = runner
        listen = self._cfg.listen
        backlog = min(max(128, self._cfg.max_connections), 4096)
        factory = functools.partial(self._make_protocol, server)
        self._site = _CappedSite(
            runner,
            listen.host,
            listen.port,
            factory,
            backlog,
            tls=self.tls,
            handshake_timeout_s=self._cfg.header_timeout_s,
        )
        await self._site.start()
        self._metrics.ingest_connections.set_function(lambda: float(len(server.connections)))
        log.info(
            "ingest.listening",
            url=self.url,
            cores=self._cores,
            producers=len(self._auth.tokens),
            client_certificates=self.tls is not None and self.tls.tls.client_ca is not None,
        )

    @property
    def port(self) -> int:
        if self._site is None:
            raise RuntimeError("IngestServer.port: call start() first")
        return self._site.port

    @property
    def url(self) -> str:
        host = self._cfg.listen.host
        host = f"[{host}]" if ":" in host else host
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    def set_tokens(self, tokens: tuple[ProducerToken, ...]) -> None:
        """The producer entries from now on (SIGHUP); requests being handled keep theirs."""
        self._auth = ProducerAuth(tokens)
        self._quotas.configure(tokens)

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """New requests get 503 from now on, and so do requests still waiting for
        their share of the body budget; requests reading their body or being
        stored finish and get acked."""
        if not self._draining:
            self._draining = True
            self._budget.refuse(self._draining_rejection)
            log.info("ingest.draining")

    def hurry(self) -> None:
        """A forced stop (a second SIGTERM): :meth:`stop` skips the grace and the wait for
        requests in progress; aiohttp's own wait for them (step 3) remains."""
        self._hurry = True

    def _not_primary(self, why: str) -> Rejection:
        """503 ``not_primary``: this daemon was the archive's primary and may not
        acknowledge now (its manifest not renewed in time, or taken over: a
        standby may be the primary); a client with other endpoints fails over."""
        return Rejection(
            503,
            "not_primary",
            f"this daemon is not the WAL archive's primary now: {why}. Retry at the "
            "other endpoint (with the same Idempotency-Key the request is stored once)",
            retry_after=self._cfg.retry_after_s,
        )

    def _standby_rejection(self, primary: str | None) -> Rejection:
        where = f"the primary is on {primary}" if primary else "no daemon holds the archive now"
        return Rejection(
            503,
            "standby",
            f'this daemon is a standby ([wal.archive] role = "standby") and acknowledges '
            f"nothing; nothing was stored: send to the primary ({where})",
            retry_after=self._cfg.retry_after_s,
            primary=primary,
        )

    def _draining_rejection(self) -> Rejection:
        return Rejection(
            503,
            "draining",
            "ingest is shutting down and takes no new requests; nothing of this request "
            "was stored; retry after the restart",
            close=True,
            retry_after=self._cfg.retry_after_s,
        )

    async def stop(self, timeout_s: float) -> None:
        """Drain within ``timeout_s``, then close (docs/ingest.md, "Draining").

        No connection is closed under a request: aiohttp ignores what arrives on
        a connection once it is closing, so a body still arriving would be cut
        and a refused request's body could not be read away (its client would
        get a reset instead of the 503).

        1. Grace: the listener and every connection stay open for
           ``ingest.drain_grace_s``, or until no connection is open. A request
           that arrives (on a kept-alive connection or a new one) gets 503
           ``draining`` with ``Connection: close``; its body is read and thrown
           away so that the client sees the answer.
        2. The listener closes. Requests in progress (a body arriving, an
           append, a refused body being read away) finish, within half the budget.
        3. Idle kept-alive connections close; aiohttp gives a request still in
           progress the rest of the budget, then cancels it.

        :meth:`hurry` (a forced stop) skips steps 1 and 2.
        """
        self.begin_drain()
        runner, site = self._runner, self._site
        if runner is None:
            return
        server = runner.server
        loop = asyncio.get_running_loop()
        budget = max(0.0, timeout_s)
        started = loop.time()
        if server is not None:
            grace_end = started + min(self._cfg.drain_grace_s, budget / 2)
            await self._wait_until(lambda: not server.connections, grace_end)
        if site is not None:
            await site.stop()
        if server is not None:
            await self._wait_until(
                lambda: all(map(_idle, server.connections)), started + budget / 2
            )
            # Idle keep-alive connections close now; busy ones (only past half the
            # budget) finish their request. aiohttp waits up to the timeout twice
            # (finish, then cancel), so each phase gets half of what is left.
            server.pre_shutdown()
            await server.shutdown(max(0.0, started + budget - loop.time()) / 2)
        await runner.cleanup()
        self._runner = None
        self._metrics.ingest_connections.set_function(lambda: 0.0)
        log.info("ingest.stopped")

    async def _wait_until(self, done: Callable[[], bool], until: float) -> None:
        """Until ``done()``, :meth:`hurry` or the loop time ``until``. aiohttp tells
        neither of a connection closing nor of one going idle: the drain looks."""
        loop = asyncio.get_running_loop()
        while not (done() or self._hurry) and loop.time() < until:  # noqa: ASYNC110
            await asyncio.sleep(DRAIN_POLL_S)

    def _make_protocol(self, server: web.Server) -> asyncio.BaseProtocol:
        """Called by the listening socket per accepted connection."""
        cap = self._cfg.max_connections
        if len(server.connections) < cap:
            return server()
        self._requests_counter(503).inc()
        response = self._over_capacity_response if self._refusing < cap else None
        self._refusing += 1
        return _Refuse(response, LINGER_S, self._refused_closed)

    def _refused_closed(self) -> None:
        self._refusing -= 1

    def _requests_counter(self, status: int) -> Any:
        child = self._m_requests.get(status)
        if child is None:
            child = self._m_requests[status] = self._metrics.ingest_requests.labels(
                code=str(status)
            )
        return child

    # -- handlers ----------------------------------------------------------

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: refuse before the client sends the body."""
        if request.headers.get("Expect", "").lower() != "100-continue":
            rej = Rejection(417, "expectation_failed", "only Expect: 100-continue is supported")
            self._requests_counter(417).inc()
            return rej.response()
        try:
            self._admit(request)
        except Rejection as rej:
            self._requests_counter(rej.status).inc()
            rej.close = True  # the body will not come: this connection is done
            return rej.response()
        if request.version == HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        return None

    async def _wrong_method(self, request: web.Request) -> web.StreamResponse:
        self._requests_counter(405).inc()
        resp = Rejection(405, "method_not_allowed", f"{request.method} {PATH}: use POST").response()
        resp.headers["Allow"] = "POST"
        return resp

    async def _not_found(self, request: web.Request) -> web.StreamResponse:
        self._requests_counter(404).inc()
        return Rejection(
            404, "not_found", f"no such endpoint {request.path}; use POST {PATH}"
        ).response()

    def _admit(self, request: web.BaseRequest) -> tuple[bool, str | None, ProducerToken | None]:
        """Step 1. Cheap checks before reading a byte of body; returns whether the body
        is NDJSON, the content coding to undo (None for none) and the producer."""
        c = self._cfg
        if self.standby is not None:
            raise self._standby_rejection(self.standby())
        if self._draining:
            raise self._draining_rejection()
        if self.archive is not None and (why := self.archive.lease_refusal()) is not None:
            raise self._not_primary(f"{why}; nothing was stored")
        if self.archive is not None and (why := self.archive.refusal()) is not None:
            raise Rejection(
                503,
                "archive_unavailable",
                f"the WAL archive cannot take events: {why}",
                retry_after=c.retry_after_s,
            )
        producer = self._authenticate(request)
        if producer is not None and (wait := self._quotas.admit(producer.name)) is not None:
            raise self._over_quota(producer, wait, "its last second's worth is spent")
        lag = self._lag()
        if lag > c.max_lag_events:
            raise Rejection(
                429,
                "over_lag_limit",
                f"the slowest consumer is {lag} events behind, over ingest.max_lag_events "
                f"({c.max_lag_events}); retry in {c.retry_after_s} s",
                retry_after=c.retry_after_s,
                lag=lag,
            )
        ctype = request.content_type
        if ctype in NDJSON_TYPES:
            ndjson = True
        elif ctype in JSON_TYPES:
            ndjson = False
        else:
            raise Rejection(
                415,
                "unsupported_media_type",
                f'Content-Type "{request.headers.get("Content-Type", "")}" is not accepted: '
                "send application/x-ndjson (one event per line) or application/json (an array)",
            )
        charset = request.charset
        if charset is not None and charset.lower() not in ("utf-8", "utf8"):
            raise Rejection(
                415, "unsupported_media_type", f'charset "{charset}" is not accepted: use utf-8'
            )
        coding = None
        if hdrs.CONTENT_ENCODING in request.headers:
            try:
                coding = content_coding(request.headers.getall(hdrs.CONTENT_ENCODING))
            except ValueError as exc:
                raise Rejection(
                    415,
                    "unsupported_content_encoding",
                    f"Content-Encoding: {exc} is not accepted: send the body as it is, "
                    "or in gzip or deflate; nothing was stored",
                ) from None
        length = request.content_length
        if length is not None and length > self._max_body:
            raise Rejection(
                413,
                "too_large",
                f"body of {length} bytes is over ingest.max_body_bytes ({self._max_body}); "
                "split it into smaller requests",
                close=True,
                limit=self._max_body,
            )
        return ndjson, coding, producer

    async def _post_events(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        nbytes = 0
        try:
            # Step 1. Admission (a producer's token or certificate included).
            ndjson, coding, producer = self._admit(request)
            scope = None if producer is None or producer.unrestricted else producer
            name = None if producer is None else producer.name  # stored with each event
            key = self._request_key(request)
            # Step 2. Read the body within the deadline and the memory budget.
            # A compressed body's Content-Length says nothing of its decoded size.
            need = request.content_length
            if need is None or coding is not None:
                need = self._max_body
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._cfg.body_timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    await self._budget.acquire(need)
            except TimeoutError:
                raise self._body_timeout() from None
            try:
                try:
                    async with asyncio.timeout_at(deadline):
                        body = await self._read_body(request, coding)
                except TimeoutError:
                    raise self._body_timeout() from None
                nbytes = len(body)
                if key is None:
                    # Steps 3 and 4. Parse, validate, shard, encode.
                    items = self._parse(body, ndjson, scope, name)
                    self._charge(producer, len(items), nbytes)
                    # Step 5. One append: atomic, consecutive LSNs, returns after fdatasync.
                    first, last = await self._append(items, None)
                    await self._archived(first, last)
                else:
                    tag = RequestTag(scoped_key(key, name), request_digest(body, ndjson))
                    stored = await self._claim(tag)
                    if stored is not None:
                        if scope is not None:
                            self._parse(body, ndjson, scope)  # a replay is in scope too
                        self._m_replays.inc()
                        await self._archived(stored[0], stored[1])
                        return self._ack(stored[0], stored[1], nbytes, started, replayed=True)
                    try:
                        items = self._parse(body, ndjson, scope, name)
                        self._charge(producer, len(items), nbytes)
                    except BaseException:
                        self._release(tag, None)
                        raise
                    # Shielded: if this handler is cancelled (shutdown), the append
                    # still ends and settles the key, so a waiting retry never
                    # appends the same key while the first append is queued.
                    appending = asyncio.ensure_future(self._append(items, tag))
                    appending.add_done_callback(functools.partial(self._settle, tag))
                    first, last = await asyncio.shield(appending)
                    await self._archived(first, last)
            finally:
                self._budget.release(need)
        except Rejection as rej:
            self._requests_counter(rej.status).inc()
            if nbytes:
                self._m_bytes.inc(nbytes)
            if rej.status == 408:
                return await self._answer_and_drop(request, rej)
            return rej.response()
        except ConnectionError:
            # The client went away mid-body: nothing was appended. 499 as in nginx.
            self._requests_counter(499).inc()
            raise
        # Step 6. The ack.
        if self.wal_full is not None:
            log.info("ingest.wal_space_back", full_s=round(time.time() - self.wal_full[0], 3))
            self.wal_full = None
        self._m_events.inc(len(items))
        if producer is not None:
            self._metrics.ingest_producer_events.labels(producer=producer.name).inc(len(items))
        return self._ack(first, last, nbytes, started)

    def _ack(
        self, first: int, last: int, nbytes: int, started: float, *, replayed: bool = False
    ) -> web.Response:
        self._m_ok.inc()
        self._m_bytes.inc(nbytes)
        self._m_latency.observe(time.perf_counter() - started)
        n = last - first + 1
        archive = self.archive
        mode = b"" if archive is None else _ACK_FIELD[archive.acks_archived]
        if replayed:
            return web.Response(
                body=b'{"accepted":%d,"first_lsn":%d,"last_lsn":%d%s,"replayed":true}'
                % (n, first, last, mode),
                content_type="application/json",
                headers={REPLAYED: "true"},
            )
        return web.Response(
            body=b'{"accepted":%d,"first_lsn":%d,"last_lsn":%d%s}' % (n, first, last, mode),
            content_type="application/json",
        )

    async def _archived(self, first: int, last: int) -> None:
        """With ``[wal.archive] ack = "archived"``: return once the archive holds
        ``last``; an outage or a fence is a 503 (the events stay in the WAL)."""
        archive = self.archive
        if archive is None:
            return
        if not archive.acks_archived:
            # A lease that lapsed while the request was written: a standby may
            # hold the archive now, so this daemon acknowledges nothing.
            if (why := archive.lease_refusal()) is not None:
                raise self._not_primary(
                    f"{why}; LSN {first}..{last} are stored in this daemon's WAL but not "
                    "acknowledged"
                )
            return
        try:
            await archive.until_archived(last)
        except ArchiveUnavailable as exc:
            if exc.fenced:
                raise self._not_primary(
                    f"{exc}; LSN {first}..{last} are stored in this daemon's WAL but not "
                    "archived nor acknowledged"
                ) from exc
            raise Rejection(
                503,
                "archive_unavailable",
                f"LSN {first}..{last} are stored in this daemon's WAL but not archived "
                f"({exc}); they are not acknowledged: retry (with the same Idempotency-Key "
                "they are stored once)",
                retry_after=self._cfg.retry_after_s,
            ) from exc

    async def _append(self, items: CoreSections, tag: RequestTag | None) -> tuple[int, int]:
        """Step 5: one WAL append, its failures turned into answers."""
        try:
            if tag is None:
                return await self._wal.append(items)
            return await self._wal.append(items, tag)
        except WalFullError as exc:
            # Nothing of the request was written; the WAL takes appends
            # again as soon as they fit (docs/wal.md, "A full volume").
            if self.wal_full is None:
                log.error("ingest.wal_full", error=str(exc), free_bytes=exc.free_bytes)
            since = self.wal_full[0] if self.wal_full else time.time()
            self.wal_full = (since, exc.nbytes, str(exc))
            raise Rejection(
                507,
                "wal_full",
                f"{exc}; nothing from this request was acknowledged",
                retry_after=self._cfg.retry_after_s,
            ) from exc
        except (WalFatalError, WalClosedError) as exc:
            if type(exc) not in self._wal_errors_logged:  # once per kind, not per request
                self._wal_errors_logged.add(type(exc))
                log.error("ingest.wal_unavailable", error=str(exc), kind=type(exc).__name__)
            raise Rejection(
                503,
                "wal_unavailable",
                f"the write-ahead log cannot take events ({exc}); nothing from this "
                "request was acknowledged; retry after the daemon restarts",
                close=True,
                retry_after=self._cfg.retry_after_s,
            ) from exc

    async def _answer_and_drop(self, request: web.Request, rej: Rejection) -> web.StreamResponse:
        """Send the answer, then close without aiohttp's lingering read: a client
        that missed the body deadline gets no more of the daemon's time."""
        resp = rej.response()
        await resp.prepare(request)
        await resp.write_eof()
        request.protocol.force_close()  # the transport flushes the answer, then closes
        return resp

    def _body_timeout(self) -> Rejection:
        t = self._cfg.body_timeout_s
        return Rejection(
            408,
            "body_timeout",
            f"the request body did not arrive within {t:g} s (ingest.body_timeout_s); "
            "nothing was stored",
            close=True,
        )

    async def _read_body(self, request: web.BaseRequest, coding: str | None) -> bytes:
        """Step 2. Chunks until EOF, ``coding`` undone; never takes more than
        ``max_body_bytes`` + 1 bytes (decoded)."""
        content = request.content
        limit = self._max_body
        decoder = None if coding is None else BodyDecoder(coding)
        chunks: list[bytes] = []
        total = 0
        try:
            while True:
                # Whatever is buffered, but never past limit + 1: the extra byte
                # tells "exactly at the limit" from "over it".
                if decoder is None:
                    chunk = await content.read(limit - total + 1)
                    if not chunk:
                        break
                else:
                    data = await content.readany()
                    if not data:
                        decoder.finish()
                        break
                    chunk = decoder.feed(data, limit - total + 1)
                    if not chunk:
                        continue
                total += len(chunk)
                if total > limit:
                    self._m_bytes.inc(total)
                    decoded = f" decoded from {coding}" if coding is not None else ""
                    raise Rejection(
                        413,
                        "too_large",
                        f"body is over ingest.max_body_bytes ({limit}) after {total} bytes"
                        f"{decoded}; split it into smaller requests",
                        close=True,
                        limit=limit,
                    )
                chunks.append(chunk)
        except (HttpProcessingError, RequestPayloadError) as exc:
            # aiohttp wraps what its parser found in the body (bad chunk framing) in
            # RequestPayloadError; the message is the parser's.
            message = getattr(exc, "message", None) or str(exc)
            raise Rejection(
                400,
                "malformed",
                f"the request body is incomplete or badly framed: {message}; nothing was stored",
                close=True,
            ) from exc
        except CodingError as exc:
            raise Rejection(400, "malformed", f"{exc}; nothing was stored", close=True) from exc
        if len(chunks) == 1:
            return chunks[0]
        return b"".join(chunks)

    # -- parsing (steps 3 and 4) ---------------------------------------------

    def _parse(
        self,
        body: bytes,
        ndjson: bool,
        scope: ProducerToken | None = None,
        producer: str | None = None,
    ) -> CoreSections:
        """Steps 3 and 4: the body's events, checked against ``scope`` and stored
        with the ``producer``'s name (None: ingest is open)."""
        if not body or body.isspace():
            raise Rejection(400, "empty", "the body holds no events; nothing was stored")
        # UTF-8, once per body: msgspec checks the strings it decodes, not the text of
        # new/old that it keeps raw, and Jackson takes overlong forms that would put
        # invalid UTF-8 into the new_json column. Python's codec refuses all of it.
        if not body.isascii() and not _valid_utf8(body):
            self._explain(body, ndjson)
            raise _disagreement(None)
        if ndjson:
            lines = body.split(b"\n")
            if len(lines) > self._max_events:
                self._check_count(sum(1 for x in lines if x.strip()))
            events: list[InEvent] = []
            append = events.append
            try:
                for line in lines:
                    if line:
                        append(_decode_one(line))
            except DECODE_ERRORS:
                # Raises unless the culprit was a blank line.
                self._explain(body, ndjson)
                try:
                    events = [_decode_one(x) for x in lines if x.strip()]
                except DECODE_ERRORS as exc:
                    raise _disagreement(exc) from exc
        else:
            try:
                events = _decode_many(body)
            except DECODE_ERRORS as exc:
                self._explain(body, ndjson)
                raise _disagreement(exc) from exc
            self._check_count(len(events))
        if not events:
            raise Rejection(400, "empty", "the body holds no events; nothing was stored")
        if scope is not None:
            self._check_scope(scope, events)
        items = self._encode(events, producer)
        if items is None:
            self._explain(body, ndjson)
            raise _disagreement(None)
        if self._strict:
            self._check_strict(events)
        return items

    def _check_strict(self, events: list[InEvent]) -> None:
        """A strict mirror's refusal, after the writers' limits: the first event
        whose ``new`` does not fit the mirror's typed columns (a 422)."""
        for index, ev in enumerate(events):
            mirrors = self._strict.get(ev.collection)
            if not mirrors or ev.op == "delete":
                continue
            doc = parse_doc(bytes(ev.new))
            for m in mirrors:
                bad = check_new(doc, m.columns)
                if bad is None:
                    continue
                field, value_type, column_type = bad
                raise Rejection(
                    422,
                    "mirror_type_mismatch",
                    f'event {index}, field "new.{field}": a {value_type} does not fit the '
                    f"{column_type} column of strict mirror {m.name!r}; nothing was stored",
                    index=index,
                    field=f"new.{field}",
                    value_type=value_type,
                    column_type=column_type,
                    mirror=m.name,
                )

    def _explain(self, body: bytes, ndjson: bool) -> None:
        """The slow path behind a refusal: raises the 400/413/422 that says what is wrong."""
        explain_body(body, ndjson, self._check_count, self._max_event_id, self._max_depth)

    def _check_count(self, n: int) -> None:
        if n > self._max_events:
            raise Rejection(
                413,
                "too_many_events",
                f"{n} events are over ingest.max_events_per_request ({self._max_events}); "
                "split them into smaller requests",
                limit=self._max_events,
            )

    def _encode(self, events: list[InEvent], producer: str | None = None) -> CoreSections | None:
        """Step 4. ``(core, payload)`` per event, split by core (``CoreSections``);
        None when an op/new/old, ``id`` length or ``time`` range rule is broken, or
        a CDC writer would refuse ``new`` or ``old`` (:mod:`daemon.ingest.payload`).

        The hot loop of ingest: keep it free of calls that are not needed. The
        payload is ``validate._stored_payload`` inlined (``encode`` instead of
        ``encode_into``: see ``validate._msgpack_encode``).
        """
        ts = time.time_ns()  # one wall-clock stamp per request
        cores = self._cores
        seeds = self._seeds
        max_event = self._max_event
        max_id = self._max_event_id
        check_from = self._check_from
        null = b"null"
        encode = _msgpack_encode
        # Per core: the events' positions in the request and their payloads. The
        # WAL takes them as sections (CoreSections): no (core, payload) tuple per
        # event, and no sort by core in the writer. The per-core lists are the
        # server's, reused (this runs on the event loop, never re-entered), and
        # only the cores this request touched are visited and emptied again, so
        # a small request pays nothing per configured core.
        positions = self._positions
        payloads = self._payloads
        used: list[int] = []
        try:
            for i, ev in enumerate(events):
                # new/old: the raw text of a JSON object, or null (absent is null too).
                # One look at the first byte tells them apart from anything else.
                text = bytes(ev.new)
                if text[0] == _LBRACE:
                    new: bytes | None = text
                elif text == null:
                    new = None
                else:
                    return None
                text = bytes(ev.old)
                if text[0] == _LBRACE:
                    old: bytes | None = text
                elif text == null:
                    old = None
                else:
                    return None
                op = ev.op
                if op == "update":
                    if new is None:
                        return None
                elif op == "insert":
                    if new is None or old is not None:
                        return None
                elif new is not None:
                    return None
                collection = ev.collection
                key = ev.key
                eid = ev.event_id
                etime = ev.event_time
                # The forms of validate._stored_payload: short (8), long (10), producer (11).
                if eid is None and etime is None and producer is None:
                    payload = encode((collection, op, key, new, old, ts, 0, ""))
                else:
                    if eid is not None and len(eid) > max_id:
                        return None
                    if etime is not None and (etime := event_time_us(etime)) is None:
                        return None
                    if producer is None:
                        payload = encode((collection, op, key, new, old, ts, 0, "", eid, etime))
                    else:
                        payload = encode(
                            (collection, op, key, new, old, ts, 0, "", eid, etime, producer)
                        )
                size = len(payload)
                if size > max_event:
                    self._event_too_large(i, size)
                # The stored event holds new and old: a short one cannot break a limit.
                if size >= check_from and self._refused(new, old):
                    return None
                seed = seeds.get(collection)
                if seed is None:
                    seed = seeds[collection] = collection_seed(collection)
                    if len(seeds) > 4096:  # a producer inventing collections: bound the cache
                        seeds.clear()
                # daemon.shard.core_of, inlined; JSON strings never hold lone surrogates,
                # so plain encode() gives the same bytes as core_of's surrogatepass.
                core = (crc32(key.encode(), seed) * cores) >> 32
                at = positions[core]
                if not at:
                    used.append(core)
                at.append(i)
                payloads[core].append(payload)
            used.sort()
            sections = [
                EncodedSection(
                    c,
                    array("I", positions[c]),
                    array("I", map(len, payloads[c])),
                    b"".join(payloads[c]),
                )
                for c in used
            ]
        finally:
            for c in used:
                positions[c].clear()
                payloads[c].clear()
        return CoreSections(sections, len(events))

    def _refused(self, new: bytes | None, old: bytes | None) -> bool:
        """Whether a CDC writer would refuse ``new`` or ``old`` (or either is nested deeper
        than ``ingest.max_json_depth``): :func:`daemon.ingest.payload.problem` on each
        long enough to break a limit."""
        for text in (new, old):
            if (
                text is not None
                and len(text) >= self._check_from
                and problem(text, self._max_depth) is not None
            ):
                return True
        return False

    def _event_too_large(self, index: int, size: int) -> None:
        raise Rejection(
            413,
            "event_too_large",
            f"event {index} is {size} bytes stored, over ingest.max_event_bytes "
            f"({self._max_event}); nothing was stored",
            index=index,
            limit=self._max_event,
        )


# A body over this is checked for UTF-8 in slices of it: never one str of its size.
_UTF8_SLICE = 1 << 20


def _valid_utf8(body: bytes) -> bool:
    """Whether ``body`` is UTF-8 by Python's strict codec (no overlong forms, surrogates,
    code points past U+10FFFF or cut sequences)."""
    if len(body) <= _UTF8_SLICE:
        try:
            body.decode()
        except UnicodeDecodeError:
            return False
        return True
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(body)
    try:
        for at in range(0, len(body), _UTF8_SLICE):
            decoder.decode(view[at : at + _UTF8_SLICE])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True
