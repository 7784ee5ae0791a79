"""The admin token: /v1/* needs it; probes stay open unless open_probes = false."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from daemon.config import AdminConfig, Listen
from daemon.service.admin import AdminServer

TOKEN = "admin-token-5b1e"
LOOPBACK = Listen("127.0.0.1", 0)


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def call(
    admin: AdminServer, method: str, path: str, token: str | None = None
) -> tuple[int, dict[str, str], str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, admin.url + path, headers=headers) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.text()


@pytest.fixture
async def guarded(start_admin: Callable[..., Any]) -> AdminServer:
    server: AdminServer = await start_admin(
        admin=AdminConfig(listen=LOOPBACK, token_sha256=sha(TOKEN))
    )
    return server


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/status"),
        ("GET", "/v1/stages"),
        ("POST", "/v1/stages/cdc:all/pause"),
        ("POST", "/v1/stages/cdc:all/resume"),
        ("POST", "/v1/cdc/orders/compact"),
        ("POST", "/v1/cdc/orders/retention"),
        ("POST", "/v1/cdc/orders/quarantine/purge"),
        ("POST", "/v1/cdc/mirror/orders/quarantine/replay"),
    ],
)
async def test_every_v1_endpoint_without_the_token_is_401_with_a_challenge(
    guarded: AdminServer, method: str, path: str
) -> None:
    status, headers, text = await call(guarded, method, path)
    assert status == 401
    assert headers["WWW-Authenticate"] == 'Bearer realm="eventplane-admin"'
    assert '"error":"unauthorized"' in text


async def test_the_token_opens_v1_and_a_wrong_one_is_401_invalid_token(
    guarded: AdminServer,
) -> None:
    status, _, text = await call(guarded, "GET", "/v1/status", TOKEN)
    assert (status, text) == (200, '{"healthy":true}')
    status, headers, text = await call(guarded, "GET", "/v1/status", TOKEN + "x")
    assert status == 401 and headers["WWW-Authenticate"].endswith('error="invalid_token"')
    assert TOKEN not in text and sha(TOKEN) not in text


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
async def test_probes_stay_open_by_default_and_close_with_open_probes_false(
    start_admin: Callable[..., Any], guarded: AdminServer, path: str
) -> None:
    assert (await call(guarded, "GET", path))[0] == 200
    closed: AdminServer = await start_admin(
        admin=AdminConfig(listen=LOOPBACK, token_sha256=sha(TOKEN), open_probes=False)
    )
    assert (await call(closed, "GET", path))[0] == 401
    assert (await call(closed, "GET", path, TOKEN))[0] == 200


async def test_without_a_token_hash_the_admin_api_stays_open(
    start_admin: Callable[..., Any],
) -> None:
    admin: AdminServer = await start_admin()
    assert (await call(admin, "GET", "/v1/status"))[0] == 200


async def test_a_new_token_hash_applies_to_the_next_request(guarded: AdminServer) -> None:
    guarded.set_access(AdminConfig(listen=LOOPBACK, token_sha256=sha("rotated")))
    assert (await call(guarded, "GET", "/v1/status", TOKEN))[0] == 401
    assert (await call(guarded, "GET", "/v1/status", "rotated"))[0] == 200
