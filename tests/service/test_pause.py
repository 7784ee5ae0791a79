"""Pausing a stage of a running event plane: durable at once, WAL retention stops
at it, the admin API and ``eventplane pause|resume`` drive it (invariants 6, 9).

Real parts: a real WAL with small segments, a real EventPlane (consumers,
planner, plan log, watermarks file), a real admin listener on loopback, the
real CLI over HTTP. Only the executor is a recording double with two stages.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon.cli.main import main as cli_main
from daemon.config import (
    AdminConfig,
    Config,
    ConsumerConfig,
    DaemonConfig,
    HealthConfig,
    Listen,
    MicrobatchConfig,
    WalConfig,
)
from daemon.plane.eventplane import EventPlane
from daemon.plane.stages import paused_problem
from daemon.service.admin import AdminServer
from daemon.service.metrics import Metrics
from tests.core.conftest import StagedExecutor
from wal import Wal


@dataclass
class Running:
    cfg: Config
    wal: Wal
    executor: StagedExecutor
    plane: EventPlane
    admin: AdminServer

    async def until(self, predicate: Callable[[], bool], within_s: float = 20.0) -> None:
        async with asyncio.timeout(within_s):
            while not predicate():  # noqa: ASYNC110 - polling plane state from outside
                await asyncio.sleep(0.002)

    async def feed(self, n: int, start: int = 0) -> None:
        """``n`` events of ~80 bytes, alternating cores, one WAL group per 10."""
        for i in range(start, start + n, 10):
            await self.wal.append(
                [(j % 2, b"%05d" % j + b"." * 70) for j in range(i, min(i + 10, start + n))]
            )

    def progress(self, stage: str) -> int:
        assert self.plane.planner is not None
        return self.plane.planner.stages.progress(stage)

    def level(self) -> bool:
        """Every stage committed every batch, and every core is at the head."""
        planner, wm = self.plane.planner, self.plane.watermarks
        assert planner is not None and wm is not None
        head = self.wal.head_lsn()
        return (
            all(planner.stages.progress(n) == planner.live_id for n in planner.stages.names)
            and min(wm.lsns) == head
        )

    def watermarks_file(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((self.cfg.data_dir / "watermarks.json").read_text())
        return doc


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    cfg = Config(
        daemon=DaemonConfig(data_dir=tmp_path / "data", cores=2),
        admin=AdminConfig(listen=Listen("127.0.0.1", 0)),
        consumer=ConsumerConfig(
            poll_min_ms=0.2, poll_max_ms=2.0, replay_retry_ms=1, watermark_flush_ms=3_600_000
        ),
        microbatch=MicrobatchConfig(interval_ms=10, retry_initial_ms=1, retry_max_ms=8),
        wal=WalConfig(segment_bytes=4096),
        health=HealthConfig(paused_max_lag_events=100),
    )
    wal = Wal.open(cfg.wal_dir, segment_bytes=4096)
    executor = StagedExecutor()
    metrics = Metrics()
    plane = EventPlane(cfg, wal, executor, metrics)
    wal.set_batch_listener(plane.on_durable_batches)
    await plane.start()
    admin = AdminServer(cfg, metrics, status=plane.status, ready=lambda: True, stages=plane)
    await admin.start()
    yield Running(cfg, wal, executor, plane, admin)
    await admin.stop(2.0)
    await plane.stop(5.0)
    await wal.aclose()


async def test_paused_stage_holds_wal_retention_until_it_caught_up_after_resume(
    running: Running,
) -> None:
    """1. 200 events commit for both stages; cdc:b is paused: the watermarks
       file says so before the call returns.
    2. 300 more events commit for cdc:a only; a flush keeps every segment
       from the first event cdc:b has not committed.
    3. Resumed, cdc:b re-runs the batches it missed with the same ids and
       rows; the next flush removes the segments and the file forgets the pause."""
    r = running
    await r.feed(200)
    await r.until(r.level)

    answer = await r.plane.pause_stage("cdc:b", reason="backfill", by="test")
    assert answer["changed"] and answer["stage"]["paused"]
    assert r.watermarks_file()["paused"]["cdc:b"]["reason"] == "backfill"
    paused_at = r.progress("cdc:b")

    await r.feed(300, start=200)
    planner = r.plane.planner
    assert planner is not None
    await r.until(
        lambda: (
            r.progress("cdc:a") == planner.live_id
            and max(planner._planned_high.values()) == r.wal.head_lsn()
        )
    )
    await r.plane.flush()
    needed = planner._first_after(paused_at)
    assert needed is not None and needed <= 201
    assert r.wal.retained_floor() <= needed  # everything cdc:b needs is on disk
    assert r.plane.watermarks is not None and min(r.plane.watermarks.lsns) <= 200
    held_segments = r.wal.segment_count()
    assert held_segments > 3  # ~500 events of ~90 bytes in 4 KiB segments
    entry = r.plane.status()["stages"][1]
    assert entry["name"] == "cdc:b" and entry["behind_batches"] > 0
    assert entry["behind_events"] == r.wal.head_lsn() - needed + 1
    assert entry["paused_over_limit"]  # over health.paused_max_lag_events = 100
    problem = paused_problem(entry, 100)
    assert problem["stage"] == "cdc:b" and "eventplane resume cdc:b" in problem["message"]
    assert "over health.paused_max_lag_events = 100" in problem["message"]
    assert "remove it from the config" in problem["message"]

    answer = await r.plane.resume_stage("cdc:b")
    assert answer["changed"] and not answer["stage"]["paused"]
    assert "paused" not in r.watermarks_file()
    await r.until(r.level)
    await r.plane.flush()

    assert r.wal.retained_floor() > needed
    assert r.wal.segment_count() < held_segments
    ran: dict[str, dict[int, list[int]]] = {"cdc:a": {}, "cdc:b": {}}
    for (bid, names), batch in zip(r.executor.calls, r.executor.attempts, strict=True):
        lsns = [rec.lsn for s in sorted(batch.slices.items()) for rec in s[1].records]
        for name in names:
            ran[name][bid] = lsns
    assert ran["cdc:b"] == ran["cdc:a"]  # same batch ids, same rows
    assert r.watermarks_file()["version"] == 2


async def post(url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        data = raw if raw is not None else (None if body is None else json.dumps(body))
        async with session.post(url, data=data) as resp:
            return resp.status, await resp.json()


async def test_admin_api_pauses_and_resumes_a_stage_idempotently_and_names_unknown_ones(
    running: Running,
) -> None:
    base = running.admin.url + "/v1/stages"

    code, doc = await post(f"{base}/cdc:b/pause", {"reason": "receiver down"})
    assert code == 200 and doc["changed"] is True
    stage = doc["stage"]
    assert (
        stage["name"] == "cdc:b" and stage["paused"] and stage["paused_reason"] == "receiver down"
    )
    assert stage["paused_by"] == "admin API client 127.0.0.1"
    code, again = await post(f"{base}/cdc:b/pause", {"reason": "other", "by": "me"})
    assert code == 200 and again["changed"] is False
    assert again["stage"]["paused_reason"] == "receiver down"  # the first pause stays
    assert again["stage"]["paused_since"] == stage["paused_since"]

    async with aiohttp.ClientSession() as session, session.get(base) as resp:
        listed = {s["name"]: s["paused"] for s in (await resp.json())["stages"]}
    assert listed == {"cdc:a": False, "cdc:b": True}

    code, doc = await post(f"{base}/cdc:nope/pause")
    assert code == 404 and doc["error"] == "unknown_stage"
    assert doc["stages"] == ["cdc:a", "cdc:b"]
    code, doc = await post(f"{base}/cdc:a/pause", raw=b"{not json")
    assert code == 400 and doc["error"] == "bad_json"
    code, doc = await post(f"{base}/cdc:a/pause", {"reason": 7})
    assert code == 400 and "reason must be a string" in doc["message"]
    assert running.plane.watermarks is not None
    assert set(running.plane.watermarks.paused) == {"cdc:b"}

    code, doc = await post(f"{base}/cdc:b/resume")
    assert code == 200 and doc["changed"] is True and doc["stage"]["paused"] is False
    code, doc = await post(f"{base}/cdc:b/resume")
    assert code == 200 and doc["changed"] is False

    await running.plane.stop(5.0)
    code, doc = await post(f"{base}/cdc:b/pause")
    assert code == 503 and doc["error"] == "not_running"


async def test_cli_pause_and_resume_print_the_new_state_and_exit_zero(
    running: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    url = running.admin.url

    def cli(*argv: str) -> int:
        return cli_main([*argv, "--url", url])

    def said(out: str) -> str:
        """What the command printed (the plane's own log lines share stdout here)."""
        return "\n".join(ln for ln in out.splitlines() if ln.startswith(("stage ", "  ")))

    code = await asyncio.to_thread(cli, "pause", "cdc:b", "--reason", "table maintenance")
    out, err = capsys.readouterr()
    assert code == 0, err
    out = said(out)
    assert out.startswith("stage cdc:b paused; now paused for 0 s by ")
    assert out.endswith(": table maintenance; 0 events behind")
    assert running.plane.watermarks is not None
    pause = running.plane.watermarks.paused["cdc:b"]
    assert pause.by is not None and "@" in pause.by  # user@host of whoever ran it

    code = await asyncio.to_thread(cli, "pause", "cdc:b")
    assert said(capsys.readouterr().out).startswith("stage cdc:b was already paused; now paused")
    assert code == 0

    code = await asyncio.to_thread(cli, "resume", "cdc:nope")
    out, err = capsys.readouterr()
    assert code == 1 and "no stage 'cdc:nope' in this daemon; its stages: cdc:a, cdc:b" in err

    code = await asyncio.to_thread(cli, "resume", "cdc:b")
    out, err = capsys.readouterr()
    assert code == 0 and said(out) == "stage cdc:b resumed; now ok"
    assert "cdc:b" not in running.plane.watermarks.paused


def test_cli_says_the_daemon_is_not_running_and_exits_three(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tests.conftest import free_port

    code = cli_main(["resume", "triggers", "--url", f"http://127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert code == 3
    assert "eventplane resume: cannot reach http://127.0.0.1:" in err
    assert "/v1/stages/triggers/resume" in err and "Is the daemon running?" in err
