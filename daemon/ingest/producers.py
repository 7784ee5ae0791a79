"""Producers at ingest: who sent a request, what it may write, and how much.

With ``[[ingest.tokens]]`` entries (or a tokens file), each request of
:class:`~daemon.ingest.server.IngestServer` is attributed to a producer
(this mixin holds the checks; the server calls them in its steps):

1. ``_authenticate``: the bearer token's entry, else the verified client
   certificate's; 401 with a ``WWW-Authenticate`` challenge otherwise
   (``_unauthorized``). No entries: ingest is open, no producer.
2. ``_charge``: 429 when the request's events or bytes are over the
   producer's quota (:mod:`daemon.ingest.quota`; ``_over_quota``).
3. ``_check_scope``: 403 unless the producer may write every event's collection.

Why and how to set producers up: docs/security.md.
"""

from __future__ import annotations

from aiohttp import hdrs, web

from daemon.config import ProducerToken
from daemon.ingest.quota import Quotas
from daemon.ingest.validate import InEvent, Rejection
from daemon.metrics import Metrics
from daemon.security import CHALLENGE_INGEST, ProducerAuth, bearer_token


class Producers:
    """Producer checks (a mixin of ``IngestServer``, which owns the state)."""

    _auth: ProducerAuth
    _quotas: Quotas
    _metrics: Metrics

    def _authenticate(self, request: web.BaseRequest) -> ProducerToken | None:
        """The request's producer: its bearer token's entry, else its verified client
        certificate's; None when ingest has no producer entries (open). 401 otherwise."""
        auth = self._auth
        if not auth.enabled:
            return None
        header = request.headers.get(hdrs.AUTHORIZATION)
        token = bearer_token(header)
        if token is not None:
            producer = auth.by_token(token)
            if producer is not None:
                return producer
            raise self._unauthorized(
                "the bearer token is not one of ingest's producer tokens", invalid=True
            )
        transport = request.transport
        peercert = transport.get_extra_info("peercert") if transport is not None else None
        producer = auth.by_certificate(peercert)
        if producer is not None:
            return producer
        if header is not None:
            raise self._unauthorized(
                'the Authorization header is not "Bearer <token>"', invalid=True
            )
        if peercert:
            raise self._unauthorized(
                "this client certificate's subject is no producer's cert_subject, and the "
                "request has no bearer token"
            )
        raise self._unauthorized("send the producer's token: Authorization: Bearer <token>")

    def _unauthorized(self, why: str, *, invalid: bool = False) -> Rejection:
        challenge = CHALLENGE_INGEST + (', error="invalid_token"' if invalid else "")
        return Rejection(
            401,
            "unauthorized",
            f"{why}; nothing was stored (docs/security.md)",
            headers={hdrs.WWW_AUTHENTICATE: challenge},
        )

    def _charge(self, producer: ProducerToken | None, events: int, nbytes: int) -> None:
        """429 when the request is over its producer's quota (daemon.ingest.quota)."""
        if producer is None:
            return
        wait = self._quotas.charge(producer.name, events, nbytes)
        if wait is not None:
            raise self._over_quota(producer, wait, f"{events} events, {nbytes} bytes")

    def _over_quota(self, producer: ProducerToken, wait: int, what: str) -> Rejection:
        self._metrics.ingest_quota_refusals.labels(producer=producer.name).inc()
        limits = ", ".join(
            f"{key} = {value}"
            for key, value in (
                ("max_events_per_s", producer.max_events_per_s),
                ("max_bytes_per_s", producer.max_bytes_per_s),
            )
            if value is not None
        )
        return Rejection(
            429,
            "over_quota",
            f'producer "{producer.name}" is over its quota ({limits}): {what}; '
            f"nothing was stored; retry in {wait} s",
            retry_after=wait,
            producer=producer.name,
        )

    def _check_scope(self, producer: ProducerToken, events: list[InEvent]) -> None:
        """403 unless ``producer`` may write every event's collection."""
        allowed: set[str] = set()
        for i, ev in enumerate(events):
            collection = ev.collection
            if collection in allowed:
                continue
            if not producer.allows(collection):
                raise Rejection(
                    403,
                    "forbidden",
                    f'producer "{producer.name}" may not write collection {collection!r} '
                    f"(event {i}); nothing of this request was stored",
                    collection=collection,
                    index=i,
                    producer=producer.name,
                )
            allowed.add(collection)
