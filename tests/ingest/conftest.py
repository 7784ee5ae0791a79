"""Fixtures for ingest tests: a real WAL in tmp_path, real servers on loopback ports."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import uvloop

from daemon.config import AdminConfig, Config, DaemonConfig, IngestConfig, Listen
from daemon.events import StoredEvent, decode
from daemon.ingest.server import IngestServer
from daemon.service.admin import AdminServer
from daemon.service.metrics import Metrics
from wal import Wal

MiB = 1 << 20


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Ingest runs on uvloop in the daemon, so its tests do too (its transports differ)."""
    return {"uvloop": uvloop.new_event_loop}


NDJSON = {"Content-Type": "application/x-ndjson"}
JSON = {"Content-Type": "application/json"}


def make_cfg(tmp_path: Path, *, cores: int = 4, **ingest: Any) -> Config:
    ingest.setdefault("listen", Listen("127.0.0.1", 0))
    return Config(
        daemon=DaemonConfig(data_dir=tmp_path / "data", cores=cores),
        ingest=IngestConfig(**ingest),
        admin=AdminConfig(listen=Listen("127.0.0.1", 0)),
    )


def event(
    i: int, *, collection: str = "orders", op: str = "insert", **extra: Any
) -> dict[str, Any]:
    e: dict[str, Any] = {"collection": collection, "op": op, "key": f"k{i}"}
    if op in ("insert", "update"):
        e["new"] = {"id": i, "amount": i * 1.5}
    e.update(extra)
    return e


def ndjson(events: list[dict[str, Any]]) -> bytes:
    return b"".join(msgspec.json.encode(e) + b"\n" for e in events)


def open_wal(directory: Path) -> Wal:
    return Wal.open(
        directory,
        segment_bytes=4 * MiB,
        fsync="always",
        fsync_interval_ms=100,
        max_group_bytes=8 * MiB,
        request_window_s=IngestConfig().idempotency_window_s,
        request_max_keys=IngestConfig().idempotency_max_keys,
    )


@pytest.fixture
async def wal(tmp_path: Path) -> AsyncIterator[Wal]:
    w = await asyncio.to_thread(open_wal, tmp_path / "wal")
    yield w
    await w.aclose()


def stored(wal: Any, from_lsn: int = 1) -> list[tuple[int, int, StoredEvent]]:
    """Every record from ``from_lsn`` as (lsn, core, event)."""
    return [(r.lsn, r.core, decode(r.payload)) for r in wal.read(from_lsn)]


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


StartIngest = Callable[..., Awaitable[IngestServer]]


@pytest.fixture
async def start_ingest(tmp_path: Path, wal: Any, metrics: Metrics) -> AsyncIterator[StartIngest]:
    servers: list[IngestServer] = []

    async def start(
        *,
        lag: Callable[[], int] = lambda: 0,
        cores: int = 4,
        wal_: Any = None,
        clock: Callable[[], float] = time.monotonic,
        **ingest: Any,
    ) -> IngestServer:
        cfg = make_cfg(tmp_path, cores=cores, **ingest)
        server = IngestServer(cfg, wal if wal_ is None else wal_, metrics, lag, clock=clock)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop(2.0)


@pytest.fixture
async def ingest(start_ingest: StartIngest) -> IngestServer:
    return await start_ingest()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    session: aiohttp.ClientSession,
    server: IngestServer,
    body: bytes,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], Any]:
    """POST a body; returns (status, headers, decoded JSON body)."""
    async with session.post(
        server.url + "/v1/events", data=body, headers=NDJSON if headers is None else headers
    ) as resp:
        raw = await resp.read()
        return resp.status, dict(resp.headers), msgspec.json.decode(raw) if raw else None


@pytest.fixture
async def baseline(
    server: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> AsyncIterator[list[Any]]:
    """One accepted request before the test; after it, the WAL must hold exactly that."""
    status, _, body = await post(http, server, ndjson([event(0), event(1)]))
    assert status == 200 and body["last_lsn"] == 2
    before = stored(wal)
    yield before
    assert wal.head_lsn() == 2
    assert stored(wal) == before


@pytest.fixture
async def start_admin(tmp_path: Path, metrics: Metrics) -> AsyncIterator[Callable[..., Any]]:
    servers: list[AdminServer] = []

    async def start(*, admin: AdminConfig | None = None, **kw: Any) -> AdminServer:
        kw.setdefault("status", lambda: {"healthy": True})
        kw.setdefault("ready", lambda: True)
        cfg = make_cfg(tmp_path)
        if admin is not None:
            cfg = dataclasses.replace(cfg, admin=admin)
        server = AdminServer(cfg, metrics, **kw)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop(2.0)


def replace_ingest(cfg: Config, **kw: Any) -> Config:
    return dataclasses.replace(cfg, ingest=dataclasses.replace(cfg.ingest, **kw))


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two CAs and their certificates, made once per session (tests/ingest/certs.py)."""
    from tests.ingest.certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))
