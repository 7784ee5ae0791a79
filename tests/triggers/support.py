"""Helpers of the trigger tests: a scriptable loopback receiver, a fake clock,
batch DataFrames built with the real SparkSession, hand-made evaluations."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from daemon.plane.batch import MicroBatch
from triggers import rows as rowsmod
from triggers.engine import TriggerEngine
from triggers.evaluate import Evaluation

BASE_TS = "2025-01-02T03:04:05.000000Z"


class FakeClock:
    """Wall clock for due times; tests move it instead of sleeping."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Reply:
    status: int = 200
    delay_s: float = 0.0
    headers: Mapping[str, str] = field(default_factory=dict)
    body: str = "ok"


@dataclass
class Received:
    headers: dict[str, str]
    body: dict[str, Any]
    status: int = 0  # what the receiver answered

    @property
    def lsns(self) -> list[int]:
        return [r["lsn"] for r in self.body["rows"]]


class Receiver:
    """A real aiohttp server on loopback. Replies come from ``script`` in order,
    then ``default``; every request is recorded (also those answered with errors)."""

    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.default = Reply()
        self.requests: list[Received] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/hook"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        reply = self.script.pop(0) if self.script else self.default
        self.requests.append(Received(dict(request.headers), body, reply.status))
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        return web.Response(status=reply.status, text=reply.body, headers=dict(reply.headers))

    def accepted(self) -> list[Received]:
        """Requests answered with a 2xx."""
        return [r for r in self.requests if 200 <= r.status < 300]

    @property
    def all_lsns(self) -> list[int]:
        return [lsn for r in self.requests for lsn in r.lsns]


def webhook(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "webhook", "url": url, **extra}


def event(
    lsn: int,
    collection: str = "orders",
    op: str = "insert",
    key: str | None = None,
    new: Any = None,
    old: Any = None,
    depth: int = 0,
    source: str = "",
    event_id: str | None = None,
    event_time: datetime | None = None,
) -> dict[str, Any]:
    return {
        "lsn": lsn, "core": lsn % 4, "seq": lsn, "collection": collection, "op": op,
        "key": key if key is not None else f"k{lsn}", "new": new, "old": old,
        "event_id": event_id, "event_time": event_time, "depth": depth, "source": source,
    }  # fmt: skip


_SCHEMA = (
    "lsn BIGINT, core INT, seq BIGINT, collection STRING, op STRING, key STRING, "
    "new STRING, old STRING, ingest_ts TIMESTAMP, batch_id BIGINT, "
    "event_id STRING, event_time TIMESTAMP, producer STRING, depth INT, source STRING"
)


def batch_df(spark: Any, events: Iterable[Mapping[str, Any]], batch_id: int = 1) -> Any:
    """The executor's batch DataFrame (new/old VARIANT via parse_json) for ``events``."""
    from pyspark.sql import functions as F

    ts = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    data = [
        (
            e["lsn"], e["core"], e["seq"], e["collection"], e["op"], e["key"],
            None if e["new"] is None else json.dumps(e["new"]),
            None if e["old"] is None else json.dumps(e["old"]),
            ts, batch_id, e.get("event_id"), e.get("event_time"), e.get("producer"), e["depth"],
            e["source"],
        )
        for e in events
    ]  # fmt: skip
    df = spark.createDataFrame(data, _SCHEMA)
    return df.withColumn("new", F.parse_json("new")).withColumn("old", F.parse_json("old"))


def batch(batch_id: int = 1) -> MicroBatch:
    return MicroBatch(batch_id, {})


async def run_batch(engine: TriggerEngine, spark: Any, df: Any, batch_id: int = 1) -> Evaluation:
    """What the Spark executor does with a stage: run_in_spark in a thread, then finish."""
    b = batch(batch_id)
    result = await asyncio.to_thread(engine.run_in_spark, spark, df, b)
    await engine.finish(b, result)
    return result


def doc(e: Mapping[str, Any], batch_id: int = 1) -> bytes:
    """A row document as Spark renders it (without the idempotency key)."""
    full = {"event_id": None, "producer": None, **e, "ingest_ts": BASE_TS, "batch_id": batch_id}
    full["event_time"] = _doc_time(e.get("event_time"))
    ordered = {k: full[k] for k in (
        "lsn", "core", "seq", "collection", "op", "key", "new", "old", "ingest_ts",
        "batch_id", "event_id", "event_time", "producer", "depth", "source")}  # fmt: skip
    return json.dumps(ordered, separators=(",", ":")).encode()


def _doc_time(value: datetime | None) -> str | None:
    """A timestamp as a row document renders it (UTC, microseconds, "Z")."""
    if value is None:
        return None
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def hand_evaluation(
    engine: TriggerEngine, matched: Mapping[str, Sequence[Mapping[str, Any]]]
) -> Evaluation:
    """An Evaluation as run_in_spark would return it, without Spark."""
    result = Evaluation(dict(engine.triggers))
    for name, events in matched.items():
        result.matched[name] = [
            rowsmod.Row(e["lsn"], rowsmod.with_key(name, e["lsn"], doc(e))) for e in events
        ]
    return result


def sample(metrics: Any, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)
