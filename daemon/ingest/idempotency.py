"""Idempotency keys: a retried request is answered from its first append, never stored twice.

A request may carry ``Idempotency-Key``; :class:`~daemon.ingest.server.IngestServer`
then, in step 3 of a request (this mixin holds the steps' code):

1. ``_request_key``: the key must be 1 to ``ingest.max_idempotency_key_bytes``
   visible ASCII characters (400 otherwise).
2. ``_claim`` with the key and the body's digest (``request_digest``): a key
   the WAL's de-duplication window knows, with the same digest, is a replay
   (200 with the original LSNs, ``Idempotent-Replayed: true``); another
   digest is a 422 (``_key_reused``); a key whose first request is still
   being stored waits for it. Otherwise this request registers the key.
3. ``_settle`` / ``_release``: the append's outcome goes to every request
   that waited on the key, and the key leaves the in-flight table.

The key travels with the WAL append (``RequestTag``), so the window survives
restarts. With producer tokens a key is the producer's own (``scoped_key``):
the window stores it behind a digest of the producer's name, so another
producer's request with the same key is a new request, never a replay or a
422 that tells it the key was used. A window written before keys were scoped
still answers an exact retry (same key, same body). Why and how clients use
it: docs/ingest.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import struct
from typing import Final, Protocol

from aiohttp import web

from daemon.ingest.validate import Rejection
from wal.format import MAX_REQUEST_KEY_BYTES, RequestEntry, RequestTag, crc32c

IDEMPOTENCY_KEY: Final = "Idempotency-Key"


REPLAYED: Final = "Idempotent-Replayed"


# What a request key's digest is: the algorithm, the content type, CRC32C and length
# of the body as read (decoded). It tells an honest retry (same bytes) from a
# key reused for another request; it is not a defence against a forged body.
_DIGEST = struct.Struct("<BBxxIQ")


_DIGEST_CRC32C_LEN = 1


_VISIBLE_ASCII: Final = re.compile(rb"[!-~]+")

# A producer's stored keys start with this byte (never in a key: keys are visible
# ASCII, so no unscoped key looks scoped) and 8 bytes of BLAKE2b of its name: a
# fixed length whatever the name, and collisions as rare as 2**-64 per pair.
_SCOPE: Final = b"\x00"
_SCOPE_DIGEST_BYTES: Final = 8
SCOPE_BYTES: Final = len(_SCOPE) + _SCOPE_DIGEST_BYTES
MAX_KEY_BYTES: Final = MAX_REQUEST_KEY_BYTES - SCOPE_BYTES  # ingest.max_idempotency_key_bytes


def scoped_key(key: bytes, producer: str | None) -> bytes:
    """The key as the window stores it: a producer's own, or as sent (open ingest)."""
    if producer is None:
        return key
    name = hashlib.blake2b(producer.encode(), digest_size=_SCOPE_DIGEST_BYTES).digest()
    return _SCOPE + name + key


def sent_key(stored: bytes) -> bytes:
    """The key as the producer sent it."""
    return stored[SCOPE_BYTES:] if stored.startswith(_SCOPE) else stored


def request_digest(body: bytes, ndjson: bool) -> bytes:
    return _DIGEST.pack(_DIGEST_CRC32C_LEN, ndjson, crc32c(body), len(body))


class _KnownRequests(Protocol):
    """What the mixin needs of the WAL (``IngestServer``'s ``WalAppender``)."""

    def find_request(self, key: bytes) -> RequestEntry | None: ...


class Idempotency:
    """Keyed requests (a mixin of ``IngestServer``, which owns the state)."""

    _max_key: int
    _in_flight: dict[bytes, tuple[bytes, asyncio.Future[tuple[int, int] | None]]]
    _wal: _KnownRequests

    def _request_key(self, request: web.BaseRequest) -> bytes | None:
        """The request's ``Idempotency-Key`` (visible ASCII, 1 to max bytes), or None."""
        raw = request.headers.get(IDEMPOTENCY_KEY)
        if raw is None:
            return None
        key = raw.encode("utf-8", "surrogateescape")
        if not 0 < len(key) <= self._max_key or _VISIBLE_ASCII.fullmatch(key) is None:
            raise Rejection(
                400,
                "bad_idempotency_key",
                f"the {IDEMPOTENCY_KEY} header must be 1 to {self._max_key} visible ASCII "
                f"characters (ingest.max_idempotency_key_bytes), got {len(key)} bytes; "
                "nothing was stored",
                limit=self._max_key,
            )
        return key

    async def _claim(self, tag: RequestTag) -> tuple[int, int] | None:
        """Step 3 for a keyed request: the stored LSNs of an earlier request with this
        key and body (a replay), or None once this request is the one to store it.

        Runs on the event loop without a suspension between the look-ups and
        the registration, so two requests with one key never both store it.
        """
        while True:
            held = self._in_flight.get(tag.key)
            if held is not None:
                digest, outcome = held
                if digest != tag.digest:
                    raise self._key_reused(tag, None)
                # Wait for the first attempt; shielded: this request going away
                # must not cancel the other one's outcome.
                await asyncio.shield(outcome)
                continue  # stored: the window has it now; not stored: try ourselves
            entry = self._wal.find_request(tag.key)
            if entry is not None:
                if entry.digest != tag.digest:
                    raise self._key_reused(tag, entry)
                return entry.first_lsn, entry.last_lsn
            unscoped = sent_key(tag.key)
            if unscoped != tag.key:
                # A window from before keys were scoped: an exact retry is a replay;
                # another body is taken as another producer's request, not a 422.
                entry = self._wal.find_request(unscoped)
                if entry is not None and entry.digest == tag.digest:
                    return entry.first_lsn, entry.last_lsn
            future: asyncio.Future[tuple[int, int] | None] = (
                asyncio.get_running_loop().create_future()
            )
            self._in_flight[tag.key] = (tag.digest, future)
            return None

    def _release(self, tag: RequestTag, outcome: tuple[int, int] | None) -> None:
        _digest, future = self._in_flight.pop(tag.key)
        future.set_result(outcome)

    def _settle(self, tag: RequestTag, appending: asyncio.Future[tuple[int, int]]) -> None:
        stored = not appending.cancelled() and appending.exception() is None
        self._release(tag, appending.result() if stored else None)

    def _key_reused(self, tag: RequestTag, entry: RequestEntry | None) -> Rejection:
        key = sent_key(tag.key).decode("ascii")
        where = (
            f"LSN {entry.first_lsn}..{entry.last_lsn}"
            if entry is not None
            else "a request still being stored"
        )
        return Rejection(
            422,
            "idempotency_key_reused",
            f"{IDEMPOTENCY_KEY} {key!r} was used for another request body ({where}); "
            "a retry must send the same body, a new request needs a new key; "
            "nothing was stored",
            key=key,
        )
