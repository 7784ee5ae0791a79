"""SIGHUP rotates the listeners' secrets of a running daemon (in this process, a real
signal): a new certificate and tokens file, and a new admin token hash."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import ssl
from pathlib import Path

import aiohttp
import pytest
from structlog.testing import capture_logs

from daemon.config import load
from daemon.security import client_context
from daemon.service.app import Daemon
from tests.ingest.certs import Pki
from tests.ingest.conftest import NDJSON, event, ndjson, open_wal

OLD, NEW = "producer-token-old", "producer-token-new"
ADMIN_OLD, ADMIN_NEW = "admin-token-old", "admin-token-new"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tokens_toml(token: str) -> str:
    return f'[[ingest.tokens]]\nname = "orders-svc"\nsha256 = "{sha(token)}"\ncollections = "*"\n'


def config_toml(admin_token: str) -> str:
    return f"""
[daemon]
data_dir = "data"
cores = 2
shutdown_timeout_s = 5.0

[ingest]
listen = "127.0.0.1:0"
tls_cert = "tls/ingest.crt"
tls_key = "tls/ingest.key"
tokens_file = "tokens.toml"

[admin]
listen = "127.0.0.1:0"
token_sha256 = "{sha(admin_token)}"

[log]
format = "json"
"""


async def test_sighup_rotates_certificate_and_tokens_and_loses_no_acknowledged_event(
    tmp_path: Path, pki: Pki
) -> None:
    """1. The daemon starts with certificate 1 (CA 1), the old producer token and
       the old admin token; a producer sends batches all along.
    2. The files change: certificate 2 (CA 2), the new tokens, the new admin
       token's hash. SIGHUP.
    3. The old producer and admin tokens get 401, the new ones are taken; a
       client trusting only CA 2 connects now.
    4. After the stop, the WAL holds every acknowledged event, exactly once."""
    (tmp_path / "tls").mkdir()
    shutil.copy(pki.server_crt, tmp_path / "tls/ingest.crt")
    shutil.copy(pki.server_key, tmp_path / "tls/ingest.key")
    (tmp_path / "tokens.toml").write_text(tokens_toml(OLD))
    config = tmp_path / "config.toml"
    config.write_text(config_toml(ADMIN_OLD))
    daemon = Daemon(load(config))
    daemon.install_signal_handlers()
    loop = asyncio.get_running_loop()
    serving = asyncio.create_task(daemon.serve())
    both_cas = ssl.create_default_context(cafile=str(pki.ca))
    both_cas.load_verify_locations(cafile=str(pki.ca2))
    acked: list[tuple[int, int]] = []
    token = OLD
    stop = asyncio.Event()

    async def produce(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal token
        i = 0
        while not stop.is_set():
            body = ndjson([event(i * 10 + j) for j in range(10)])
            headers = {**NDJSON, "Authorization": f"Bearer {token}"}
            async with session.post(url, data=body, headers=headers, ssl=both_cas) as resp:
                doc = await resp.json()
            if resp.status == 401:
                token = NEW  # nothing of the refused batch was stored: send it again
                continue
            assert resp.status == 200, doc
            acked.append((doc["first_lsn"], doc["last_lsn"]))
            i += 1

    try:
        for _ in range(200):
            if daemon.started:
                break
            await asyncio.sleep(0.05)
        assert daemon.started and daemon.ingest is not None and daemon.admin is not None
        events_url = daemon.ingest.url + "/v1/events"
        status_url = daemon.admin.url + "/v1/status"
        async with aiohttp.ClientSession() as session:
            producer = asyncio.create_task(produce(session, events_url))
            await asyncio.sleep(0.3)
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await session.get(daemon.ingest.url, ssl=client_context(pki.ca2))

            # Step 2. New files, then SIGHUP.
            shutil.copy(pki.server2_crt, tmp_path / "tls/ingest.crt")
            shutil.copy(pki.server2_key, tmp_path / "tls/ingest.key")
            (tmp_path / "tokens.toml").write_text(tokens_toml(NEW))
            config.write_text(config_toml(ADMIN_NEW))
            acked_before = len(acked)
            os.kill(os.getpid(), signal.SIGHUP)

            # Step 3. The old token is refused once the reload is done.
            for _ in range(200):
                if token == NEW and len(acked) > acked_before + 3:
                    break
                await asyncio.sleep(0.05)
            assert token == NEW, "the old producer token was never refused"
            stop.set()
            await producer
            probe = {**NDJSON, "Authorization": f"Bearer {OLD}"}
            async with session.post(
                events_url, data=ndjson([event(0)]), headers=probe, ssl=both_cas
            ) as resp:
                assert resp.status == 401
            async with session.get(daemon.ingest.url, ssl=client_context(pki.ca2)) as resp:
                assert resp.status == 404  # a TLS handshake with CA 2, then an HTTP answer
            for admin_token, expected in ((ADMIN_OLD, 401), (ADMIN_NEW, 200)):
                headers = {"Authorization": f"Bearer {admin_token}"}
                async with session.get(status_url, headers=headers) as resp:
                    assert resp.status == expected
    finally:
        daemon.request_exit("test")
        await serving
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    # Step 4. Every acknowledged event, once.
    wal = await asyncio.to_thread(open_wal, tmp_path / "data" / "wal")
    try:
        lsns = [r.lsn for r in wal.read(1)]
    finally:
        await wal.aclose()
    expected = [lsn for first, last in acked for lsn in range(first, last + 1)]
    assert acked_before > 0 and len(acked) > acked_before
    assert lsns == expected


async def test_a_missing_tokens_file_stops_the_start_with_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        '[daemon]\ndata_dir = "data"\ncores = 1\n'
        '[ingest]\nlisten = "127.0.0.1:0"\ntokens_file = "missing.toml"\n'
        '[admin]\nlisten = "127.0.0.1:0"\n'
    )
    daemon = Daemon(load(config))
    with capture_logs() as logs:
        assert await daemon.serve() == 2
    failed = [e for e in logs if e["event"] == "startup.failed"]
    assert failed and "ingest.tokens_file: file not found" in str(failed[0])


async def test_an_open_ingest_off_loopback_is_warned_about_at_start(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        '[daemon]\ndata_dir = "data"\ncores = 1\n'
        '[ingest]\nlisten = "0.0.0.0:0"\n[admin]\nlisten = "127.0.0.1:0"\n'
    )
    daemon = Daemon(load(config))
    with capture_logs() as logs:
        serving = asyncio.create_task(daemon.serve())
        for _ in range(200):
            if daemon.started:
                break
            await asyncio.sleep(0.05)
        daemon.request_exit("test")
        assert await serving == 0
    warned = [e for e in logs if e["event"] == "security.ingest_open"]
    assert warned and warned[0]["log_level"] == "warning"
    assert "security.admin_open" not in [e["event"] for e in logs]
