"""The admin listener: metrics, health, readiness and status."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from daemon.service.admin import STALL_S, AdminServer
from daemon.service.metrics import Metrics


async def get(url: str) -> tuple[int, str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        ctype = resp.headers["Content-Type"]
        body = await (resp.json() if ctype.startswith("application/json") else resp.text())
        return resp.status, ctype, body


async def test_metrics_are_served_in_prometheus_text_format(
    start_admin: Callable[..., Any], metrics: Metrics
) -> None:
    metrics.ingest_requests.labels(code="200").inc(3)
    admin: AdminServer = await start_admin()
    status, ctype, text = await get(admin.url + "/metrics")
    assert status == 200
    assert ctype.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["eventplane_ingest_requests"].samples
    assert any(s.labels == {"code": "200"} and s.value == 3 for s in samples)


async def test_healthz_is_200_while_the_loop_runs(start_admin: Callable[..., Any]) -> None:
    admin = await start_admin()
    status, _, doc = await get(admin.url + "/healthz")
    assert status == 200 and doc["status"] == "ok"


async def test_healthz_is_503_after_the_loop_stalled(start_admin: Callable[..., Any]) -> None:
    """The clock is injected: the loop "stalls" by moving it past STALL_S."""
    now = {"t": 1000.0}
    admin = await start_admin(clock=lambda: now["t"])
    now["t"] += STALL_S + 1.0
    status, _, doc = await get(admin.url + "/healthz")
    assert status == 503
    assert doc["status"] == "stalled"
    assert "the event loop did not run for" in doc["message"]


async def test_readyz_follows_ready_and_draining(start_admin: Callable[..., Any]) -> None:
    state = {"ready": False}
    admin = await start_admin(ready=lambda: state["ready"])
    status, _, doc = await get(admin.url + "/readyz")
    assert (status, doc["ready"]) == (503, False)
    state["ready"] = True
    status, _, doc = await get(admin.url + "/readyz")
    assert (status, doc) == (200, {"ready": True})


async def test_health_names_the_role_and_a_standby_is_never_ready(
    start_admin: Callable[..., Any],
) -> None:
    primary = await start_admin()
    assert (await get(primary.url + "/healthz"))[2]["role"] == "primary"
    standby = await start_admin(role="standby", ready=lambda: False)
    status, _, doc = await get(standby.url + "/healthz")
    assert (status, doc["status"], doc["role"]) == (200, "ok", "standby")
    status, _, doc = await get(standby.url + "/readyz")
    assert (status, doc["ready"], doc["role"]) == (503, False, "standby")
    assert doc["message"] == "a standby takes no events: send them to the primary"


async def test_status_serves_the_injected_document(start_admin: Callable[..., Any]) -> None:
    doc = {"healthy": True, "wal": {"head_lsn": 7, "dir": Path("/var/x")}, "cores": [{"core": 0}]}
    admin = await start_admin(status=lambda: doc)
    status, ctype, got = await get(admin.url + "/v1/status")
    assert status == 200 and ctype.startswith("application/json")
    assert got == {"healthy": True, "wal": {"head_lsn": 7, "dir": "/var/x"}, "cores": [{"core": 0}]}


async def test_status_failure_is_a_500_with_the_reason(start_admin: Callable[..., Any]) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("plane not started")

    admin = await start_admin(status=broken)
    status, _, doc = await get(admin.url + "/v1/status")
    assert status == 500
    assert "plane not started" in doc["message"]


async def test_admin_binds_a_free_port_and_stops(start_admin: Callable[..., Any]) -> None:
    admin = await start_admin()
    assert admin.port > 0
    await admin.stop(1.0)
    await admin.stop(1.0)  # idempotent


async def test_a_retention_run_is_asked_of_the_daemon_over_the_admin_api(
    start_admin: Any, http: aiohttp.ClientSession
) -> None:
    asked: list[str] = []

    async def run_retention(stream: str) -> dict[str, Any]:
        asked.append(stream)
        if stream != "all":
            raise ValueError(f"no CDC stream {stream!r} with retention")
        return {"partitions": 2, "files": 5, "bytes": 1000, "rows": 40}

    admin = await start_admin(retention=run_retention)
    async with http.post(admin.url + "/v1/cdc/all/retention") as resp:
        assert resp.status == 200
        assert await resp.json() == {
            "stream": "all",
            "partitions": 2,
            "files": 5,
            "bytes": 1000,
            "rows": 40,
        }
    async with http.post(admin.url + "/v1/cdc/nope/retention") as resp:
        assert resp.status == 404
        assert "no CDC stream 'nope'" in (await resp.json())["message"]
    assert asked == ["all", "nope"]


async def test_healthz_names_a_quarantine_but_stays_200(start_admin: Callable[..., Any]) -> None:
    notice = {"part": "stream all", "quarantined": 2, "message": "stream all holds 2 row(s)"}
    admin = await start_admin(notices=lambda: [notice])
    status, _, doc = await get(admin.url + "/healthz")
    assert status == 200 and doc["status"] == "ok" and doc["notices"] == [notice]


async def test_a_quarantine_replay_or_purge_is_asked_of_the_daemon_with_its_lsns(
    start_admin: Any, http: aiohttp.ClientSession
) -> None:
    """The body's LSNs and ``by`` reach the executor; an unknown stream is a
    404, a body that is not the expected JSON a 400, Spark not ready a 503."""
    from daemon.errors import ExecutorError, UnknownStreamError

    asked: list[tuple[str, str, set[int] | None, str | None]] = []

    async def act(
        stream: str, action: str, lsns: set[int] | None, by: str | None
    ) -> dict[str, Any]:
        asked.append((stream, action, lsns, by))
        if stream == "nope":
            raise UnknownStreamError(f"no CDC stream {stream!r}")
        if stream == "cold":
            raise ExecutorError("Spark is not ready: try the replay again shortly")
        return {"stream": stream, "purged": len(lsns or ()), "quarantined": 0}

    admin = await start_admin(quarantine=act)
    url = admin.url + "/v1/cdc/{}/quarantine/{}"
    async with http.post(url.format("all", "purge"), json={"lsns": [7, 9], "by": "ops"}) as r:
        assert r.status == 200 and (await r.json())["purged"] == 2
    async with http.post(url.format("all", "replay")) as r:
        assert r.status == 200
    async with http.post(url.format("nope", "replay")) as r:
        assert r.status == 404
    async with http.post(url.format("cold", "replay")) as r:
        assert r.status == 503 and "not ready" in (await r.json())["message"]
    async with http.post(url.format("all", "purge"), data=b'{"lsns": ["x"]}') as r:
        assert r.status == 400
    async with http.post(url.format("all", "drop")) as r:
        assert r.status in (404, 405)
    assert asked[:2] == [("all", "purge", {7, 9}, "ops"), ("all", "replay", None, None)]


async def test_a_mirror_quarantine_action_reaches_the_mirrors_executor_not_the_streams(
    start_admin: Any, http: aiohttp.ClientSession
) -> None:
    from daemon.errors import UnknownStreamError

    asked: list[tuple[str, str, set[int] | None, str | None]] = []

    async def act(name: str, action: str, lsns: set[int] | None, by: str | None) -> Any:
        asked.append((name, action, lsns, by))
        if name == "nope":
            raise UnknownStreamError(f"no mirror {name!r}")
        return {"mirror": name, "replayed": 1, "quarantined": 0}

    async def streams(*_: Any) -> Any:
        raise AssertionError("a mirror's action went to the streams")

    url = "/v1/cdc/mirror/{}/quarantine/{}"
    admin = await start_admin(quarantine=streams, mirror_quarantine=act)
    async with http.post(admin.url + url.format("orders", "replay"), json={"lsns": [3]}) as r:
        assert r.status == 200 and (await r.json())["replayed"] == 1
    async with http.post(admin.url + url.format("nope", "purge")) as r:
        assert r.status == 404 and "no mirror 'nope'" in (await r.json())["message"]
    assert asked == [("orders", "replay", {3}, None), ("nope", "purge", None, None)]
    without = await start_admin()
    async with http.post(without.url + url.format("orders", "replay")) as r:
        assert r.status == 503 and "no mirror" in (await r.json())["message"]


async def test_neither_listener_names_its_python_or_aiohttp_version(
    start_admin: Callable[..., Any], start_ingest: Callable[..., Any]
) -> None:
    admin = await start_admin()
    ingest = await start_ingest()
    async with aiohttp.ClientSession() as http:
        for url in (admin.url + "/healthz", admin.url + "/nope", ingest.url + "/v1/events"):
            async with http.get(url) as resp:
                assert resp.headers["Server"] == "eventplane", (url, resp.headers["Server"])
