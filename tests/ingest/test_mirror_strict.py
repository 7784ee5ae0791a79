"""A strict mirror's refusals at ingest (docs/cdc.md, "Mirror tables"): an event
of its collection whose ``new`` does not fit the typed columns is answered 422
naming the event, field, value type and column type, and nothing of the
request is stored; what fits, other collections and deletes are taken."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon.config import CdcConfig, CdcMirror
from daemon.ingest.server import IngestServer
from tests.ingest.conftest import make_cfg, ndjson, post, stored

COLUMNS = (
    ("amount", "decimal(8,2)"),
    ("n", "long"),
    ("placed", "timestamp"),
    ("paid", "boolean"),
    ("note", "string"),
)


@pytest.fixture
async def server(tmp_path: Path, wal: Any, metrics: Any) -> AsyncIterator[IngestServer]:
    mirrors = (
        CdcMirror("orders", "orders", tmp_path / "m", COLUMNS, strict=True),
        CdcMirror("loose", "loose", tmp_path / "l", COLUMNS, strict=False),
    )
    cfg = dataclasses.replace(make_cfg(tmp_path), cdc=CdcConfig(mirrors=mirrors))
    s = IngestServer(cfg, wal, metrics, lambda: 0)
    await s.start()
    yield s
    await s.stop(2.0)


def ev(new: Any, *, collection: str = "orders", op: str = "insert", key: str = "k") -> Any:
    out: dict[str, Any] = {"collection": collection, "op": op, "key": key}
    if new is not None:
        out["new"] = new
    return out


FITS = {"amount": 12.5, "n": 3, "placed": "2024-05-01T10:00:00Z", "paid": True, "note": "x"}
REFUSED = [
    ({"amount": "12.5"}, "amount", "string", "decimal(8,2)"),
    ({"amount": 12.345}, "amount", "number", "decimal(8,2)"),
    ({"n": 1.5}, "n", "number", "long"),
    ({"n": "3"}, "n", "string", "long"),
    ({"placed": "tomorrow"}, "placed", "string", "timestamp"),
    ({"placed": True}, "placed", "boolean", "timestamp"),
    ({"paid": 1}, "paid", "number", "boolean"),
    ({"note": {"a": 1}}, "note", "object", "string"),
    ({"note": [1]}, "note", "array", "string"),
]


@pytest.mark.parametrize(
    ("change", "field", "value_type", "column_type"),
    REFUSED,
    ids=[r[1] + "-" + r[2] for r in REFUSED],
)
async def test_a_value_that_does_not_fit_is_422_and_nothing_is_stored(
    server: IngestServer,
    http: aiohttp.ClientSession,
    wal: Any,
    change: dict[str, Any],
    field: str,
    value_type: str,
    column_type: str,
) -> None:
    body = ndjson([ev(FITS, key="a"), ev({**FITS, **change}, key="b"), ev(FITS, key="c")])
    code, _, doc = await post(http, server, body)
    assert code == 422, doc
    assert doc["error"] == "mirror_type_mismatch"
    assert (doc["index"], doc["field"], doc["value_type"], doc["column_type"]) == (
        1,
        f"new.{field}",
        value_type,
        column_type,
    )
    assert doc["mirror"] == "orders"
    assert "event 1" in doc["message"] and "nothing was stored" in doc["message"]
    assert wal.head_lsn() == 0 and stored(wal) == []


async def test_what_fits_nulls_other_collections_and_deletes_are_taken(
    server: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    body = ndjson(
        [
            ev(FITS),
            ev({"amount": None, "extra": "anything"}),  # null and missing fields fit
            ev(None, op="delete"),
            ev({"amount": "not a number"}, collection="loose"),  # not strict: nulled later
            ev({"amount": "not a number"}, collection="other"),
        ]
    )
    code, _, doc = await post(http, server, body)
    assert code == 200, doc
    assert len(stored(wal)) == 5
