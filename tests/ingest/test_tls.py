"""TLS on the ingest and admin listeners, over real loopback handshakes.

Certificates come from tests/ingest/certs.py (the ``openssl`` command). Each
refusal is asserted, then a good request on the same listener shows it unharmed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import pytest

from daemon.config import ProducerToken, TlsConfig
from daemon.errors import ConfigError
from daemon.ingest.server import IngestServer
from daemon.security import ServerTls, client_context, subject_string
from tests.ingest.certs import CLIENT_SUBJECT, Pki
from tests.ingest.conftest import NDJSON, StartIngest, event, ndjson
from wal import Wal

BODY = ndjson([event(1)])


async def send(
    server: IngestServer, ctx: ssl.SSLContext | bool, body: bytes = BODY, url: str | None = None
) -> tuple[int, Any]:
    """POST on a new connection; (status, JSON body)."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            (url or server.url) + "/v1/events", data=body, headers=NDJSON, ssl=ctx
        ) as resp,
    ):
        raw = await resp.read()
        return resp.status, msgspec.json.decode(raw) if raw else None


def server_tls(pki: Pki, *, mutual: bool = False) -> TlsConfig:
    return TlsConfig(pki.server_crt, pki.server_key, pki.ca if mutual else None)


async def test_ingest_over_tls_stores_events_for_a_client_that_trusts_the_ca(
    start_ingest: StartIngest, pki: Pki, wal: Wal
) -> None:
    server = await start_ingest(tls=server_tls(pki))
    assert server.url.startswith("https://127.0.0.1:")
    status, body = await send(server, client_context(pki.ca))
    assert (status, body["accepted"], wal.head_lsn()) == (200, 1, 1)


async def test_a_client_that_does_not_trust_the_servers_ca_fails_the_handshake(
    start_ingest: StartIngest, pki: Pki, wal: Wal
) -> None:
    server = await start_ingest(tls=server_tls(pki))
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await send(server, client_context(pki.ca2))
    assert wal.head_lsn() == 0
    assert (await send(server, client_context(pki.ca)))[0] == 200


async def test_plain_http_to_a_tls_port_gets_no_answer_and_the_listener_keeps_serving(
    start_ingest: StartIngest, pki: Pki, wal: Wal
) -> None:
    server = await start_ingest(tls=server_tls(pki))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()
    assert not answer.startswith(b"HTTP/"), "a TLS port never answers in plain HTTP"
    assert wal.head_lsn() == 0
    assert (await send(server, client_context(pki.ca)))[0] == 200


async def test_tls_to_a_plain_port_fails_the_handshake_and_the_listener_keeps_serving(
    ingest: IngestServer, pki: Pki, wal: Wal
) -> None:
    https = ingest.url.replace("http://", "https://")
    with pytest.raises(aiohttp.ClientConnectorError):
        await send(ingest, client_context(pki.ca), url=https)
    assert (await send(ingest, False))[0] == 200


# -- mutual TLS ----------------------------------------------------------------


@pytest.fixture
async def mutual(start_ingest: StartIngest, pki: Pki) -> IngestServer:
    return await start_ingest(tls=server_tls(pki, mutual=True))


async def test_mutual_tls_takes_a_certificate_its_ca_signed(
    mutual: IngestServer, pki: Pki, wal: Wal
) -> None:
    status, _ = await send(mutual, client_context(pki.ca, pki.client_crt, pki.client_key))
    assert (status, wal.head_lsn()) == (200, 1)


@pytest.mark.parametrize("client", ["none", "expired", "other-ca"])
async def test_mutual_tls_refuses_a_client_without_a_valid_certificate_in_the_handshake(
    mutual: IngestServer, pki: Pki, wal: Wal, client: str
) -> None:
    cert = {"none": None, "expired": pki.expired_crt, "other-ca": pki.stranger_crt}[client]
    key = {"none": None, "expired": pki.expired_key, "other-ca": pki.stranger_key}[client]
    with pytest.raises((aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, ssl.SSLError)):
        await send(mutual, client_context(pki.ca, cert, key))
    assert wal.head_lsn() == 0
    good = client_context(pki.ca, pki.client_crt, pki.client_key)
    assert (await send(mutual, good))[0] == 200


async def test_a_client_certificate_stands_in_for_a_token_with_its_scope(
    start_ingest: StartIngest, pki: Pki, wal: Wal
) -> None:
    tokens = (ProducerToken("orders-svc", collections=("orders",), cert_subject=CLIENT_SUBJECT),)
    server = await start_ingest(tls=server_tls(pki, mutual=True), tokens=tokens)
    ctx = client_context(pki.ca, pki.client_crt, pki.client_key)
    assert (await send(server, ctx))[0] == 200
    status, body = await send(server, ctx, ndjson([event(2, collection="payments")]))
    assert (status, body["error"], body["producer"]) == (403, "forbidden", "orders-svc")
    assert wal.head_lsn() == 1


async def test_a_certificate_no_entry_names_is_401_when_tokens_are_configured(
    start_ingest: StartIngest, pki: Pki, wal: Wal
) -> None:
    tokens = (ProducerToken("other", collections=("*",), cert_subject="CN=someone-else"),)
    server = await start_ingest(tls=server_tls(pki, mutual=True), tokens=tokens)
    status, body = await send(server, client_context(pki.ca, pki.client_crt, pki.client_key))
    assert (status, body["error"]) == (401, "unauthorized")
    assert "cert_subject" in body["message"]
    assert wal.head_lsn() == 0


def test_subject_string_is_openssls_rfc2253_form() -> None:
    cert = {"subject": ((("organizationName", "Acme, Inc"),), (("commonName", "orders-svc"),))}
    assert subject_string(cert) == "CN=orders-svc,O=Acme\\, Inc"


# -- rotation ------------------------------------------------------------------


async def _request_on(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes = BODY
) -> bytes:
    writer.write(
        b"POST /v1/events HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-ndjson\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)
    return head.split(b"\r\n")[0]


async def test_reload_serves_new_handshakes_the_new_certificate_and_open_connections_keep_theirs(
    start_ingest: StartIngest, pki: Pki, wal: Wal
) -> None:
    """1. A connection opens with the first certificate (CA 1).
    2. The listener reloads to a certificate CA 2 signed.
    3. A client trusting only CA 2 now connects; one trusting only CA 1 does not.
    4. The connection from step 1 still carries requests."""
    server = await start_ingest(tls=server_tls(pki))
    assert server.tls is not None
    old = await asyncio.open_connection("127.0.0.1", server.port, ssl=client_context(pki.ca))
    assert await _request_on(*old) == b"HTTP/1.1 200 OK"
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await send(server, client_context(pki.ca2))

    server.tls.reload(TlsConfig(pki.server2_crt, pki.server2_key))

    assert (await send(server, client_context(pki.ca2)))[0] == 200
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await send(server, client_context(pki.ca))
    assert await _request_on(*old) == b"HTTP/1.1 200 OK"
    old[1].close()
    assert wal.head_lsn() == 3


def test_a_bad_reload_keeps_the_current_context_and_says_which_file(pki: Pki) -> None:
    tls = ServerTls(server_tls(pki), "ingest")
    before = tls.tls
    with pytest.raises(ConfigError, match=r"ingest\.tls_cert, ingest\.tls_key: cannot use"):
        tls.reload(TlsConfig(pki.server_crt, pki.server2_key))  # a key of another certificate
    with pytest.raises(ConfigError, match=r"ingest\.tls_key: file not found"):
        tls.reload(TlsConfig(pki.server_crt, pki.server_key.with_name("missing.key")))
    with pytest.raises(ConfigError, match="needs a restart"):
        tls.reload(server_tls(pki, mutual=True))
    assert tls.tls is before


# -- the admin listener ----------------------------------------------------------


async def test_admin_over_mutual_tls_needs_a_client_certificate(
    start_admin: Callable[..., Any], pki: Pki
) -> None:
    admin = await start_admin(tls=ServerTls(server_tls(pki, mutual=True), "admin"))
    assert admin.url.startswith("https://")
    good = client_context(pki.ca, pki.client_crt, pki.client_key)
    async with aiohttp.ClientSession() as session:
        async with session.get(admin.url + "/v1/status", ssl=good) as resp:
            assert resp.status == 200
        with pytest.raises((aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)):
            async with session.get(admin.url + "/healthz", ssl=client_context(pki.ca)) as resp:
                await resp.read()
