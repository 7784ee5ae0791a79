"""Shard assignment: which core owns an event (invariant 3, per-key order).

The core is a pure function of ``(collection, key, cores)`` that must give the
same answer in every process, on every machine and in every release, because
per-key order across restarts depends on it. Python's ``hash()`` is salted per
process, so it is out. The function, fixed by this module's tests::

    h    = crc32( u32_le(len(c)) || c || k )    # zlib's CRC-32; c, k = UTF-8 of collection, key
    core = (h * cores) >> 32                     # multiply-shift onto 0 .. cores-1

The length prefix keeps ``("ab", "c")`` and ``("a", "bc")`` apart. Multiply-
shift uses the hash's high bits, which spread evenly for any ``cores``, where
``h % cores`` would lean on the low bits only. The collection's part of the
CRC is cached, so a lookup costs one CRC over the key. zlib's ``crc32`` takes
half the time of the ``crc32c`` package's call on short keys (about 60 ns
against 120 ns, measured), and that is the cost per event at ingest.
"""

from __future__ import annotations

import struct
from zlib import crc32

_U32 = struct.Struct("<I")  # length prefix of the collection, little-endian
# Collections are few (tens) in any deployment; the cap only guards against a
# producer that invents a collection per event.
_PREFIX_CACHE_MAX = 4096
_prefix_cache: dict[str, int] = {}


def collection_seed(collection: str) -> int:
    """CRC-32 of ``u32_le(len) || collection``: the running value the key continues."""
    seed = _prefix_cache.get(collection)
    if seed is None:
        raw = collection.encode("utf-8", "surrogatepass")
        seed = crc32(_U32.pack(len(raw)) + raw)
        if len(_prefix_cache) >= _PREFIX_CACHE_MAX:
            _prefix_cache.clear()
        _prefix_cache[collection] = seed
    return seed


def core_of(collection: str, key: str, cores: int) -> int:
    """The core (0 .. cores-1) that owns ``(collection, key)``; stable everywhere."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    h = crc32(key.encode("utf-8", "surrogatepass"), collection_seed(collection))
    return (h * cores) >> 32
