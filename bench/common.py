"""Pieces the benchmarks share: the ingest POST and a loopback webhook receiver."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from aiohttp import web


async def post_events(session: Any, ingest: str, body: bytes) -> dict[str, Any]:
    """POST an NDJSON body to ``<ingest>/v1/events``; wait out 429s; the ack as a dict.

    Any other non-200 answer ends the benchmark with the daemon's message.
    """
    headers = {"Content-Type": "application/x-ndjson"}
    while True:
        async with session.post(f"{ingest}/v1/events", data=body, headers=headers) as r:
            if r.status == 429:
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if r.status != 200:
                raise SystemExit(f"ingest answered {r.status}: {await r.text()}")
            return dict(await r.json())


def _stat(pid: int | str) -> list[bytes]:
    """Fields of /proc/<pid>/stat after the command name, from field 3 (state) on."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all threads), from /proc/<pid>/stat."""
    fields = _stat(pid)
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def process_tree(root: int, skip: frozenset[int] = frozenset()) -> list[int]:
    """``root`` and its live descendants (e.g. the JVM pyspark starts), without the
    subtrees of the pids in ``skip``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat(entry)[1])  # field 4 of proc(5)
        except OSError:  # exited while we looked
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in skip:
            continue
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def total_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of the given processes, which must outlive the measurement."""
    return sum(cpu_seconds(pid) for pid in pids)


class HookServer:
    """aiohttp on loopback (``POST /hook``) in its own thread and event loop.

    It does not share the sender's loop, only the GIL, as a local receiver
    would. Subclasses implement ``_handle``; ``url`` is set by ``start``.
    """

    def __init__(self) -> None:
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-receiver", daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the receiver did not start within 10 s")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/hook"

    async def _handle(self, request: web.Request) -> web.Response:
        raise NotImplementedError

    def stop(self) -> None:
        async def cleanup() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_daemon(
    folder: Path, admin: int, what: str = "the daemon", path: str = "/readyz"
) -> subprocess.Popen[bytes]:
    """``eventplane run --config config.toml`` in ``folder``, once its admin port
    ``admin`` answers ``path`` (within 60 s; a standby answers ``/healthz``, never
    ``/readyz``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli.main", "run", "--config", "config.toml"],
        cwd=folder,
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}{path}", timeout=1):
                return proc
        except OSError:
            time.sleep(0.1)
