"""The admin listener: ``/metrics``, ``/healthz``, ``/readyz``, ``/v1/status``.

Probes and scrapes, kept off the ingest listener so that a flood of events
never delays a health check, and so the two can bind different interfaces.

- ``GET /metrics``: the daemon's Prometheus registry, text exposition format.
- ``GET /healthz``: 200 while the daemon is healthy: its event loop is
  responsive and nothing is stalled. A ticker task on the loop measures how
  late its wake-ups are; if the last tick is older than :data:`STALL_S` the
  loop was stuck (a blocking call) and the answer is 503 with the measured
  stall. A stalled stage or micro-batch path (the injected ``problems()``,
  see ``Daemon.problems``) is a 503 too, with one entry per problem. Each
  answer names the daemon's ``role`` (``[wal.archive] role``).
- ``GET /readyz``: 200 once the daemon is ready and not draining, else 503;
  a standby is never ready (it takes no events).
- ``GET /v1/status``: the injected ``status()`` document as JSON (the schema
  is the daemon's; ``eventplane status`` renders it).
- ``GET /v1/stages``: every stage's status entry.
- ``POST /v1/stages/{name}/pause`` (optional JSON body ``{"reason": "...",
  "by": "..."}``) and ``POST /v1/stages/{name}/resume``: pause or resume a
  stage (``daemon.plane.stages``), durably; 200 with ``changed`` (false when
  it already was) and the stage's entry, 404 with the stage names for an
  unknown one, 503 while the daemon starts or drains. These are the only
  endpoints that change anything: keep the admin listener on loopback or a
  management network (docs/operating.md, "Pausing a stage").
- ``POST /v1/cdc/{stream}/compact`` (``?dry_run=1``: only the plan) and
  ``GET /v1/cdc/{stream}/compaction``: ``eventplane cdc compact`` asks the
  daemon's compaction service (``daemon.table.compact``) through these.
- ``POST /v1/cdc/{stream}/retention``: one retention run of the stream now
  (``eventplane cdc retention --apply`` while the daemon runs).
- ``POST /v1/cdc/{stream}/quarantine/{replay|purge}``, JSON body ``{"lsns":
  [..] | null, "by": "..."}``: ``eventplane cdc quarantine replay|purge``
  while the daemon runs (docs/cdc.md, "Quarantine").
- ``POST /v1/cdc/mirror/{mirror}/quarantine/{replay|purge}``, the same body:
  ``eventplane cdc mirror quarantine replay|purge`` (docs/cdc.md, "Mirror tables").

With ``[admin] token_sha256`` set, every ``/v1/*`` request needs
``Authorization: Bearer <token>`` (or a client certificate, when
``[admin] tls_client_ca`` asks for one: the handshake checked it), else 401;
``/healthz``, ``/readyz`` and ``/metrics`` stay open unless ``open_probes =
false`` (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import structlog
from aiohttp import web

from daemon.config import AdminConfig, Config
from daemon.errors import DaemonError, UnknownStreamError
from daemon.ingest.listener import name_server
from daemon.plane.stages import PAUSE_TEXT_CHARS, StagesNotRunningError, UnknownStageError
from daemon.security import CHALLENGE_ADMIN, ServerTls, bearer_token, token_matches
from daemon.service.metrics import Metrics

log = structlog.get_logger("eventplane.admin")

# Metric names are classic ones (underscores), so the 0.0.4 text format every
# Prometheus version parses is exact; prometheus_client's "latest" says 1.0.0.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The loop-responsiveness ticker wakes this often; cheap (one timer per tick).
TICK_S = 0.25
# A loop whose last tick is this old is reported stuck. Probes time out after
# a few seconds (kubelet and systemd defaults are 1-10 s); 2 s is well past
# any GC pause and well short of those.
STALL_S = 2.0
# A pause request's JSON body (a reason and an author) is small.
MAX_PAUSE_BODY_BYTES = 16 * 1024
# A quarantine replay/purge body lists LSNs: ~2 MiB holds 100k of them.
MAX_QUARANTINE_BODY_BYTES = 2 * 1024 * 1024
# What probes and Prometheus read; open without the token unless open_probes = false.
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class StageControl(Protocol):
    """Pauses and resumes stages (``EventPlane``)."""

    async def pause_stage(
        self, name: str, *, reason: str | None = None, by: str | None = None
    ) -> dict[str, Any]: ...

    async def resume_stage(self, name: str) -> dict[str, Any]: ...


def _json_default(value: Any) -> Any:
    return str(value)  # Paths, enums and the like in a status document


_encode = msgspec.json.Encoder(enc_hook=_json_default).encode


def _json(status: int, doc: Any) -> web.Response:
    return web.Response(status=status, body=_encode(doc), content_type="application/json")


class AdminServer:
    """Serves the admin endpoints on ``admin.listen`` (port 0 picks one; see ``port``)."""

    def __init__(
        self,
        cfg: Config,
        metrics: Metrics,
        status: Callable[[], dict[str, Any]],
        ready: Callable[[], bool],
        *,
        problems: Callable[[], list[dict[str, Any]]] | None = None,
        notices: Callable[[], list[dict[str, Any]]] | None = None,
        stages: StageControl | None = None,
        clock: Callable[[], float] | None = None,
        compaction: Any = None,
        retention: Callable[[str], Awaitable[dict[str, Any]]] | None = None,
        quarantine: Callable[..., Awaitable[dict[str, Any]]] | None = None,
        mirror_quarantine: Callable[..., Awaitable[dict[str, Any]]] | None = None,
        tls: ServerTls | None = None,
        role: str = "primary",
    ) -> None:
        self._listen = cfg.admin.listen
        self._role = role  # [wal.archive] role: health says it, a standby is never ready
        if tls is None and cfg.admin.tls.enabled:
            tls = ServerTls(cfg.admin.tls, "admin")
        self.tls = tls
        self._access = cfg.admin
        self._stages = stages
        self._metrics = metrics
        self._status = status
        self._ready = ready
        self._problems = problems
        self._notices = notices  # what health names without failing (a quarantine)
        self._clock = clock
        self._compaction = compaction  # daemon.table.compact.CompactionService
        self._retention = retention  # SparkExecutor.run_retention
        self._quarantine = quarantine  # SparkExecutor.quarantine_action
        self._mirror_quarantine = mirror_quarantine  # MirrorQuarantine.mirror_quarantine_action
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._last_tick = 0.0

    def set_access(self, admin: AdminConfig) -> None:
        """The token hash and ``open_probes`` from now on (SIGHUP)."""
        self._access = admin

    @web.middleware
    async def _authorize(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        access = self._access
        expected = access.token_sha256
        if expected is None or (access.open_probes and request.path in PROBE_PATHS):
            return await handler(request)
        header = request.headers.get("Authorization")
        if token_matches(bearer_token(header), expected):
            return await handler(request)
        transport = request.transport
        if transport is not None and transport.get_extra_info("peercert"):
            return await handler(request)  # tls_client_ca's CA signed it: the handshake said so
        challenge = CHALLENGE_ADMIN + (', error="invalid_token"' if header else "")
        return web.Response(
            status=401,
            body=_encode(
                {
                    "error": "unauthorized",
                    "message": "the admin API needs its token: Authorization: Bearer <token> "
                    "(eventplane commands: --token-file or $EVENTPLANE_ADMIN_TOKEN_FILE; "
                    "docs/security.md)",
                }
            ),
            content_type="application/json",
            headers={"WWW-Authenticate": challenge},
        )

    async def start(self) -> None:
        app = web.Application(middlewares=[self._authorize])
        app.on_response_prepare.append(name_server)
        app.router.add_get("/metrics", self._get_metrics)
        app.router.add_get("/healthz", self._get_healthz)
        app.router.add_get("/readyz", self._get_readyz)
        app.router.add_get("/v1/status", self._get_status)
        app.router.add_get("/v1/stages", self._get_stages)
        app.router.add_post("/v1/stages/{name}/pause", self._post_pause)
        app.router.add_post("/v1/stages/{name}/resume", self._post_resume)
        app.router.add_post("/v1/cdc/{stream}/compact", self._post_compact)
        app.router.add_get("/v1/cdc/{stream}/compaction", self._get_compaction)
        app.router.add_post("/v1/cdc/{stream}/retention", self._post_retention)
        app.router.add_post(
            "/v1/cdc/{stream}/quarantine/{action:replay|purge}", self._post_quarantine
        )
        app.router.add_post(
            "/v1/cdc/mirror/{mirror}/quarantine/{action:replay|purge}",
            self._post_mirror_quarantine,
        )
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=30.0)
        await runner.setup()
        self._runner = runner
        self._site = web.TCPSite(
            runner,
            self._listen.host,
            self._listen.port,
            reuse_address=True,
            ssl_context=None if self.tls is None else self.tls.context,
        )
        await self._site.start()
        self._last_tick = self._now()
        self._ticker = asyncio.create_task(self._tick(), name="admin-loop-ticker")
        log.info("admin.listening", url=self.url)

    @property
    def port(self) -> int:
        if self._site is None:
            raise RuntimeError("AdminServer.port: call start() first")
        return self._site.port

    @property
    def url(self) -> str:
        host = self._listen.host
        host = f"[{host}]" if ":" in host else host
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    async def stop(self, timeout_s: float) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        runner = self._runner
        if runner is None:
            return
        if self._site is not None:
            await self._site.stop()
        server = runner.server
        if server is not None:
            server.pre_shutdown()
            await server.shutdown(max(0.0, timeout_s) / 2)
        await runner.cleanup()
        self._runner = None
        log.info("admin.stopped")

    # -- loop responsiveness -----------------------------------------------

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def _tick(self) -> None:
        try:
            while True:
                await asyncio.sleep(TICK_S)
                self._last_tick = self._now()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("admin.ticker_failed")
            raise

    def loop_stall_s(self) -> float:
        """How long the loop has gone without a tick, beyond the tick interval."""
        return max(0.0, self._now() - self._last_tick - TICK_S)

    # -- handlers ----------------------------------------------------------

    async def _get_metrics(self, request: web.Request) -> web.StreamResponse:
        body = self._metrics.render()
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _get_healthz(self, request: web.Request) -> web.StreamResponse:
        stall = self.loop_stall_s()
        ticker_alive = self._ticker is not None and not self._ticker.done()
        if stall > STALL_S or not ticker_alive:
            return _json(
                503,
                {
                    "status": "stalled",
                    "message": f"the event loop did not run for {stall:.1f} s (limit {STALL_S:g} s)"
                    if ticker_alive
                    else "the loop-responsiveness ticker is not running",
                    "loop_stall_s": round(stall, 3),
                    "role": self._role,
                },
            )
        try:
            problems = self._problems() if self._problems is not None else []
        except Exception as exc:
            log.exception("admin.health_failed")
            problems = [{"part": "admin", "message": f"health check failed: {exc}"}]
        if problems:
            return _json(
                503,
                {
                    "status": "unhealthy",
                    "message": "; ".join(str(p.get("message")) for p in problems),
                    "problems": problems,
                    "loop_stall_s": round(stall, 3),
                    "role": self._role,
                },
            )
        body: dict[str, Any] = {
            "status": "ok",
            "loop_stall_s": round(stall, 3),
            "role": self._role,
        }
        try:
            notices = self._notices() if self._notices is not None else []
        except Exception:
            log.exception("admin.notices_failed")
            notices = []
        if notices:
            body["notices"] = notices
        return _json(200, body)

    async def _get_readyz(self, request: web.Request) -> web.StreamResponse:
        try:
            ready = bool(self._ready())
        except Exception as exc:
            log.exception("admin.ready_failed")
            return _json(503, {"ready": False, "message": f"readiness check failed: {exc}"})
        if ready:
            return _json(200, {"ready": True})
        if self._role == "standby":
            return _json(
                503,
                {
                    "ready": False,
                    "role": "standby",
                    "message": "a standby takes no events: send them to the primary",
                },
            )
        return _json(503, {"ready": False, "message": "starting up or draining"})

    async def _get_status(self, request: web.Request) -> web.StreamResponse:
        try:
            doc = self._status()
        except Exception as exc:
            log.exception("admin.status_failed")
            return _json(500, {"error": "status_failed", "message": f"status failed: {exc}"})
        return _json(200, doc)

    # -- stages: pause and resume ------------------------------------------

    async def _get_stages(self, request: web.Request) -> web.StreamResponse:
        try:
            doc = self._status()
        except Exception as exc:
            log.exception("admin.status_failed")
            return _json(500, {"error": "status_failed", "message": f"status failed: {exc}"})
        return _json(200, {"stages": doc.get("stages", [])})

    async def _post_pause(self, request: web.Request) -> web.StreamResponse:
        body = await _pause_body(request)
        if isinstance(body, web.Response):
            return body
        by = body.get("by") or f"admin API client {request.remote or 'unknown'}"
        return await self._stage_action(
            request, "pause", lambda c, name: c.pause_stage(name, reason=body.get("reason"), by=by)
        )

    async def _post_resume(self, request: web.Request) -> web.StreamResponse:
        return await self._stage_action(request, "resume", lambda c, name: c.resume_stage(name))

    async def _stage_action(
        self, request: web.Request, action: str, call: Callable[[StageControl, str], Any]
    ) -> web.StreamResponse:
        name = request.match_info["name"]
        control = self._stages
        if control is None:
            return _json(
                503, {"error": "not_running", "message": "this daemon does not run stages"}
            )
        try:
            answer: dict[str, Any] = await call(control, name)
        except UnknownStageError as exc:
            return _json(
                404, {"error": "unknown_stage", "message": str(exc), "stages": list(exc.names)}
            )
        except StagesNotRunningError as exc:
            return _json(503, {"error": "not_running", "message": str(exc)})
        except Exception as exc:
            log.exception("admin.stage_action_failed", action=action, stage=name)
            return _json(
                500,
                {"error": f"{action}_failed", "message": f"{action} of stage {name} failed: {exc}"},
            )
        return _json(200, answer)  # the change itself is logged: stage.paused, stage.resumed

    # -- CDC compaction ------------------------------------------------------

    def _compaction_for(self, request: web.Request) -> tuple[Any, str, web.Response | None]:
        svc, stream = self._compaction, request.match_info["stream"]
        if svc is None or stream not in svc.streams():
            known = ", ".join(svc.streams()) if svc is not None else ""
            return (
                svc,
                stream,
                _json(
                    404,
                    {
                        "error": "unknown_stream",
                        "message": f"no CDC stream named {stream!r} (streams: {known or 'none'})",
                    },
                ),
            )
        return svc, stream, None

    async def _post_compact(self, request: web.Request) -> web.StreamResponse:
        svc, stream, missing = self._compaction_for(request)
        if missing is not None:
            return missing
        if request.query.get("dry_run", "").lower() in ("1", "true", "yes"):
            plans = await asyncio.to_thread(svc.plan, stream)
            return _json(200, {"stream": stream, "dry_run": True, "plans": plans})
        rid = svc.request(stream)
        return _json(202, {"stream": stream, "request": rid, "status": svc.status(stream)})

    async def _post_retention(self, request: web.Request) -> web.StreamResponse:
        """One retention run of the stream now (what ``eventplane cdc retention
        --apply`` asks a running daemon for); 404 for a stream without retention."""
        stream = request.match_info["stream"]
        run = self._retention
        if run is None:
            return _json(503, {"error": "not_running", "message": "this daemon runs no CDC"})
        try:
            result = await run(stream)
        except Exception as exc:  # ExecutorError: no such stream, or no retention
            return _json(404, {"error": "no_retention", "message": str(exc)})
        status = 500 if result.get("error") else 200
        return _json(status, {"stream": stream, **result})

    async def _post_quarantine(self, request: web.Request) -> web.StreamResponse:
        """Replay or purge a stream's quarantined rows (``eventplane cdc quarantine``)."""
        stream = request.match_info["stream"]
        return await _quarantine_action(
            request, self._quarantine, stream, "this daemon runs no CDC"
        )

    async def _post_mirror_quarantine(self, request: web.Request) -> web.StreamResponse:
        """Replay or purge a mirror's quarantined events (``eventplane cdc mirror quarantine``)."""
        mirror = request.match_info["mirror"]
        return await _quarantine_action(
            request, self._mirror_quarantine, mirror, "this daemon runs no mirror"
        )

    async def _get_compaction(self, request: web.Request) -> web.StreamResponse:
        svc, stream, missing = self._compaction_for(request)
        if missing is not None:
            return missing
        return _json(200, svc.status(stream))


async def _quarantine_action(
    request: web.Request,
    act: Callable[..., Awaitable[dict[str, Any]]] | None,
    name: str,
    not_running: str,
) -> web.StreamResponse:
    """A quarantine replay or purge of stream or mirror ``name`` by ``act``
    (the executor's), its body ``{"lsns": [..] | null, "by": "..."}``."""
    action = request.match_info["action"]
    if act is None:
        return _json(503, {"error": "not_running", "message": not_running})
    if request.content_length and request.content_length > MAX_QUARANTINE_BODY_BYTES:
        return _json(413, {"error": "too_large", "message": "list at most ~100k LSNs"})
    try:
        body = msgspec.json.decode(await request.read() or b"{}")
        lsns = body.get("lsns")
        by = body.get("by")
        if lsns is not None:
            lsns = {int(x) for x in lsns}
        if by is not None and not isinstance(by, str):
            raise TypeError("by: expected a string")
    except (msgspec.DecodeError, ValueError, TypeError, AttributeError) as exc:
        msg = f'expected {{"lsns": [integers] | null, "by": "who"}}: {exc}'
        return _json(400, {"error": "bad_request", "message": msg})
    try:
        result = await act(name, action, lsns, by)
    except UnknownStreamError as exc:
        return _json(404, {"error": "no_stream", "message": str(exc)})
    except DaemonError as exc:  # Spark not ready: retry
        return _json(503, {"error": "refused", "message": str(exc)})
    return _json(200, result)


async def _pause_body(request: web.Request) -> dict[str, str] | web.Response:
    """The optional JSON body of a pause: ``reason`` and ``by``, strings."""
    if request.content_length and request.content_length > MAX_PAUSE_BODY_BYTES:
        return _json(413, {"error": "too_large", "message": "a pause body is a small JSON object"})
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return _json(400, {"error": "bad_json", "message": f"the body is not JSON: {exc}"})
    if not isinstance(doc, dict):
        return _json(400, {"error": "bad_body", "message": "the body must be a JSON object"})
    out: dict[str, str] = {}
    for key in ("reason", "by"):
        value = doc.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > PAUSE_TEXT_CHARS:
            return _json(
                400,
                {
                    "error": "bad_body",
                    "message": f"{key} must be a string of at most {PAUSE_TEXT_CHARS} characters",
                },
            )
        out[key] = value
    return out
