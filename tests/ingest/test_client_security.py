"""The clients and commands with tokens and TLS: ``daemon.client``, ``eventplane send``,
``eventplane status`` / ``pause`` against guarded listeners."""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import access, status
from daemon.cli.main import build_parser, main
from daemon.client import (
    ForbiddenError,
    IngestClient,
    Retry,
    SyncIngestClient,
    UnauthorizedError,
)
from daemon.config import AdminConfig, Listen, ProducerToken, TlsConfig, parse
from daemon.security import client_context
from tests.ingest.certs import Pki
from tests.ingest.conftest import StartIngest, event, ndjson, stored
from tests.ingest.test_client_send import run_send

TOKEN = "producer-token-c41d"
ADMIN_TOKEN = "admin-token-9e2a"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


TOKENS = (ProducerToken("orders-svc", collections=("orders",), sha256=sha(TOKEN)),)


def secret_file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


async def test_async_client_sends_its_token_over_tls_and_401_403_are_not_retried(
    start_ingest: StartIngest, pki: Pki, wal: Any
) -> None:
    server = await start_ingest(tokens=TOKENS, tls=TlsConfig(pki.server_crt, pki.server_key))
    retries: list[Retry] = []
    ctx = client_context(pki.ca)
    async with IngestClient(server.url, token=TOKEN, ssl_context=ctx, on_retry=retries.append) as c:
        ack = await c.send([event(1)])
        assert (ack.accepted, ack.first_lsn) == (1, 1)
        with pytest.raises(ForbiddenError) as forbidden:
            await c.send([event(2, collection="payments")])
    assert forbidden.value.body["collection"] == "payments"
    assert (forbidden.value.attempts, forbidden.value.gave_up) == (1, False)
    async with IngestClient(server.url, token="wrong", ssl_context=ctx) as c:
        with pytest.raises(UnauthorizedError) as unauthorized:
            await c.send([event(3)])
    assert unauthorized.value.attempts == 1 and unauthorized.value.status == 401
    assert retries == []
    assert [e.key for _, _, e in stored(wal)] == ["k1"]


async def test_sync_client_with_a_client_certificate_and_a_token(
    start_ingest: StartIngest, pki: Pki, wal: Any
) -> None:
    server = await start_ingest(
        tokens=TOKENS, tls=TlsConfig(pki.server_crt, pki.server_key, pki.ca)
    )
    ctx = client_context(pki.ca, pki.client_crt, pki.client_key)

    def send_twice() -> tuple[int, type[BaseException] | None]:
        with SyncIngestClient(server.url, token=TOKEN, ssl_context=ctx) as c:
            ack = c.send([event(1)])
        with SyncIngestClient(server.url, ssl_context=ctx, retry_for_s=60) as c:
            try:
                c.send([event(2)])
            except UnauthorizedError as exc:
                assert exc.attempts == 1
                return ack.accepted, type(exc)
        return ack.accepted, None

    assert await asyncio.to_thread(send_twice) == (1, UnauthorizedError)
    assert wal.head_lsn() == 1


async def test_send_reads_its_token_file_and_ca_file_and_stops_at_a_403(
    start_ingest: StartIngest, pki: Pki, wal: Any, tmp_path: Path
) -> None:
    server = await start_ingest(tokens=TOKENS, tls=TlsConfig(pki.server_crt, pki.server_key))
    token_file = secret_file(tmp_path / "token", TOKEN)
    args = ("--token-file", str(token_file), "--ca-file", str(pki.ca), "--batch", "2")
    code, out, err = await run_send(tmp_path, server.url, ndjson([event(1), event(2)]), *args)
    assert code == 0, err
    assert out.startswith("sent 2 events in 1 requests, LSN 1..2")
    events = [event(3), event(4, collection="payments")]
    code, out, err = await run_send(tmp_path, server.url, ndjson(events), *args)
    assert code == 1
    assert "HTTP 403 forbidden" in err and "'payments'" in err
    assert "attempt 2" not in err, "a 403 is not retried"
    assert TOKEN not in err
    assert wal.head_lsn() == 2


async def test_send_without_its_token_is_refused_once_with_a_401(
    start_ingest: StartIngest, wal: Any, tmp_path: Path
) -> None:
    server = await start_ingest(tokens=TOKENS)
    code, _, err = await run_send(tmp_path, server.url, ndjson([event(1)]))
    assert code == 1
    assert "HTTP 401 unauthorized" in err and "attempt 2" not in err
    assert wal.head_lsn() == 0


# -- admin commands ----------------------------------------------------------------


@pytest.fixture
async def admin_tls(start_admin: Callable[..., Any], pki: Pki) -> Any:
    return await start_admin(
        admin=AdminConfig(
            listen=Listen("127.0.0.1", 0),
            tls=TlsConfig(pki.server_crt, pki.server_key),
            token_sha256=sha(ADMIN_TOKEN),
        )
    )


async def test_status_takes_the_token_from_the_environment_and_the_ca_file(
    admin_tls: Any, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = secret_file(tmp_path / "admin-token", ADMIN_TOKEN)
    monkeypatch.setenv(access.ENV_ADMIN_TOKEN_FILE, str(token_file))
    args = build_parser().parse_args(
        ["status", "--url", admin_tls.url, "--ca-file", str(pki.ca), "--json"]
    )
    out = io.StringIO()
    admin = access.from_args(args, access.ENV_ADMIN_TOKEN_FILE)
    code = await asyncio.to_thread(status.main, args, parse({}), out, admin)
    assert code == 0
    assert '"healthy": true' in out.getvalue()


async def test_status_without_the_admin_token_is_refused_with_the_daemons_words(
    admin_tls: Any, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["status", "--url", admin_tls.url, "--ca-file", str(pki.ca)]
    assert await asyncio.to_thread(main, argv) == 1
    assert "answered HTTP 401: the admin API needs its token" in capsys.readouterr().err


def test_an_unreadable_token_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["pause", "cdc:all", "--url", "http://127.0.0.1:1", "--token-file", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"eventplane pause: --token-file {tmp_path}: cannot read the token" in err


def test_admin_url_and_ingest_url_use_https_for_a_tls_listener() -> None:
    from daemon.cli.send import ingest_url

    cfg = parse(
        {
            "ingest": {"listen": "0.0.0.0:8470", "tls_cert": "a.crt", "tls_key": "a.key"},
            "admin": {"listen": "127.0.0.1:9470", "tls_cert": "a.crt", "tls_key": "a.key"},
        }
    )
    assert ingest_url(cfg) == "https://127.0.0.1:8470"
    assert status.admin_url(cfg) == "https://127.0.0.1:9470/v1/status"
    assert status.admin_url(parse({})) == "http://127.0.0.1:9470/v1/status"


def test_a_key_without_its_certificate_is_a_usage_error() -> None:
    args = build_parser().parse_args(["status", "--key", "client.key"])
    with pytest.raises(access.AccessError, match="--key needs --cert"):
        access.from_args(args, access.ENV_ADMIN_TOKEN_FILE, environ={})
