"""A request body's ``Content-Encoding``: the codings ingest undoes, and a bounded decoder.

Ingest undoes ``gzip`` (also spelt ``x-gzip``, members may follow one another)
and ``deflate`` (zlib's format, or raw deflate as some clients send it);
``identity`` is no coding. Anything else, or two codings on one body, is a 415
before the body is read. A body that is not valid in its coding, or whose
stream stops before its end (a truncated gzip would otherwise pass as a
shorter body), is a 400 (docs/ingest.md, "Compressed bodies").

aiohttp's own decoding is off (``auto_decompress=False`` in
``IngestServer.start``): it answered a corrupt body with a 500, passed a
truncated gzip stream on, and handed a body in a coding it does not know over
as if it were plain.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

CODINGS = ("gzip", "x-gzip", "deflate")
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZLIB_WBITS = zlib.MAX_WBITS
_RAW_DEFLATE_WBITS = -zlib.MAX_WBITS


class CodingError(Exception):
    """The body is not valid in its ``Content-Encoding``; the message says how."""


def content_coding(values: Iterable[str]) -> str | None:
    """The coding to undo, from the request's ``Content-Encoding`` header values; None
    for none. Raises ValueError with a sentence naming what is not supported."""
    tokens = [t.strip().lower() for value in values for t in value.split(",")]
    tokens = [t for t in tokens if t and t != "identity"]
    if not tokens:
        return None
    if len(tokens) > 1:
        raise ValueError(f"more than one content coding ({', '.join(tokens)})")
    if tokens[0] not in CODINGS:
        raise ValueError(f'content coding "{tokens[0]}"')
    return tokens[0]


class BodyDecoder:
    """Undoes one coding as the body arrives, never making more than it is asked for."""

    __slots__ = ("_coding", "_members", "_stream")

    def __init__(self, coding: str) -> None:
        self._coding = "gzip" if coding == "x-gzip" else coding
        self._stream: zlib._Decompress | None = None  # None: before a stream or a member
        self._members = 0  # streams (gzip members) that ended

    def feed(self, data: bytes, max_length: int) -> bytes:
        """The decoded bytes of ``data``, at most ``max_length`` (a caller that gets that
        many has more than it takes, and stops). Raises CodingError."""
        out: list[bytes] = []
        try:
            while data and max_length > 0:
                stream = self._stream
                if stream is None:
                    if self._members and self._coding != "gzip":
                        raise CodingError(f"data after the end of the {self._coding} stream")
                    stream = self._stream = zlib.decompressobj(self._wbits(data))
                chunk = stream.decompress(data, max_length)
                out.append(chunk)
                max_length -= len(chunk)
                if not stream.eof:
                    break  # all of data was taken, or max_length was reached
                # A stream (a gzip member) ended: what follows is the next member.
                self._members += 1
                self._stream = None
                data = stream.unused_data
        except zlib.error as exc:
            raise CodingError(f"the body is not valid {self._coding} ({exc})") from None
        return b"".join(out)

    def finish(self) -> None:
        """At the body's end: raises CodingError unless its last stream ended there."""
        if self._stream is not None or not self._members:
            raise CodingError(
                f"the body's {self._coding} stream is truncated: it ends before its "
                "end-of-stream marker"
            )

    def _wbits(self, data: bytes) -> int:
        if self._coding == "gzip":
            return _GZIP_WBITS
        # RFC 1950: a zlib stream's first byte says method 8 (deflate) in its low bits;
        # without that header the body is raw deflate (RFC 1951), as some clients send.
        return _ZLIB_WBITS if data[0] & 0x0F == 8 else _RAW_DEFLATE_WBITS
