"""Producer tokens on ingest: who may write, and which collections.

A request without a known bearer token gets 401 (``WWW-Authenticate``) and a
collection outside its producer's scope 403 naming it; either way the WAL is
untouched. docs/security.md is the user's page.
"""

from __future__ import annotations

import hashlib
import hmac
import random
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import pytest

from daemon import security
from daemon.config import Config, IngestConfig, Listen, ProducerToken, parse
from daemon.errors import ConfigError
from daemon.ingest.server import IngestServer
from tests.ingest.conftest import NDJSON, StartIngest, event, ndjson, post, stored
from wal import Wal

ORDERS_TOKEN = "orders-secret-1f0c9a7e2b4d6c8a"
AUDIT_TOKEN = "audit-secret-77e0d1"
ADMIN_OF_ALL = "all-collections-secret"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


TOKENS = (
    ProducerToken(
        "orders-svc",
        collections=("orders", "payments"),
        collection_prefixes=("audit.",),
        sha256=sha(ORDERS_TOKEN),
    ),
    ProducerToken("auditor", collection_prefixes=("audit.",), sha256=sha(AUDIT_TOKEN)),
    ProducerToken("backfill", collections=("*",), sha256=sha(ADMIN_OF_ALL)),
)


def bearer(token: str, **extra: str) -> dict[str, str]:
    return {**NDJSON, "Authorization": f"Bearer {token}", **extra}


@pytest.fixture
async def guarded(start_ingest: StartIngest) -> IngestServer:
    return await start_ingest(tokens=TOKENS)


async def test_a_request_without_a_token_is_401_with_a_challenge_and_stores_nothing(
    guarded: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    status, headers, body = await post(http, guarded, ndjson([event(1)]))
    assert status == 401
    assert headers["WWW-Authenticate"] == 'Bearer realm="eventplane-ingest"'
    assert body["error"] == "unauthorized"
    assert "Authorization: Bearer" in body["message"]
    assert wal.head_lsn() == 0


@pytest.mark.parametrize(
    "authorization",
    ["Bearer not-a-known-token", "Basic b3JkZXJzOnNlY3JldA==", f"Bearer  {ORDERS_TOKEN}x"],
)
async def test_an_unknown_token_or_scheme_is_401_invalid_token_and_stores_nothing(
    guarded: IngestServer, http: aiohttp.ClientSession, wal: Wal, authorization: str
) -> None:
    headers = {**NDJSON, "Authorization": authorization}
    status, got, body = await post(http, guarded, ndjson([event(1)]), headers)
    assert status == 401
    assert got["WWW-Authenticate"].endswith('error="invalid_token"')
    assert body["error"] == "unauthorized"
    assert ORDERS_TOKEN not in body["message"]
    assert wal.head_lsn() == 0


async def test_a_token_writes_its_collections_and_prefixes(
    guarded: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    events = [
        event(1, collection="orders"),
        event(2, collection="payments"),
        event(3, collection="audit.logins"),
    ]
    status, _, body = await post(http, guarded, ndjson(events), bearer(ORDERS_TOKEN))
    assert (status, body["accepted"]) == (200, 3)
    status, _, body = await post(
        http, guarded, ndjson([event(4, collection="anything")]), bearer(ADMIN_OF_ALL)
    )
    assert status == 200
    assert sorted(e.collection for _, _, e in stored(wal)) == [
        "anything",
        "audit.logins",
        "orders",
        "payments",
    ]


async def test_a_collection_outside_the_scope_is_403_naming_it_and_stores_nothing(
    guarded: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    events = [event(1, collection="audit.x"), event(2, collection="orders")]
    status, headers, body = await post(http, guarded, ndjson(events), bearer(AUDIT_TOKEN))
    assert status == 403
    assert "WWW-Authenticate" not in headers
    assert body["error"] == "forbidden"
    assert (body["collection"], body["index"], body["producer"]) == ("orders", 1, "auditor")
    assert "'orders'" in body["message"] and "nothing" in body["message"]
    assert wal.head_lsn() == 0


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "idempotency-key"])
async def test_one_out_of_scope_event_among_1000_stores_nothing(
    guarded: IngestServer, http: aiohttp.ClientSession, wal: Wal, keyed: bool
) -> None:
    """Seeded inputs: 1,000 events of collections the token may write, one of them
    replaced by a collection it may not, at a drawn position; then the same body
    without it is stored whole."""
    rng = random.Random(29)
    allowed = ["orders", "payments", "audit.a", "audit.b.c"]
    refused = ["order", "paymentsx", "audit", "Audit.a", "orders ", "auditx.a"]
    for round_ in range(6):
        events = [event(i, collection=rng.choice(allowed)) for i in range(1000)]
        bad_at = rng.randrange(1000)
        events[bad_at] = event(bad_at, collection=refused[round_])
        extra = {"Idempotency-Key": f"k-{round_}"} if keyed else {}
        status, _, body = await post(http, guarded, ndjson(events), bearer(ORDERS_TOKEN, **extra))
        assert status == 403, body
        assert (body["collection"], body["index"]) == (refused[round_], bad_at)
        assert wal.head_lsn() == 0
    events[bad_at] = event(bad_at, collection="orders")
    status, _, body = await post(http, guarded, ndjson(events), bearer(ORDERS_TOKEN))
    assert (status, body["accepted"], wal.head_lsn()) == (200, 1000, 1000)


async def test_a_key_is_its_producers_own_and_another_producers_same_key_is_a_new_request(
    guarded: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    """1. backfill stores a body with key K (LSN 1).
    2. auditor sends it with K: a request of its own, out of its scope: 403.
    3. orders-svc sends it with K: a new request, stored (LSN 2), no replay;
       its retry is a replay of LSN 2, and K with another body is its 422.
    4. backfill's K with another body is still backfill's 422, naming LSN 1."""
    body = ndjson([event(1, collection="orders")])
    other = ndjson([event(2, collection="orders")])
    key = {"Idempotency-Key": "shared-key"}
    status, _, first = await post(http, guarded, body, bearer(ADMIN_OF_ALL, **key))
    assert (status, first["first_lsn"]) == (200, 1)
    status, _, refused = await post(http, guarded, body, bearer(AUDIT_TOKEN, **key))
    assert (status, refused["error"]) == (403, "forbidden")
    status, _, own = await post(http, guarded, body, bearer(ORDERS_TOKEN, **key))
    assert (status, own["first_lsn"], own.get("replayed")) == (200, 2, None)
    status, _, again = await post(http, guarded, body, bearer(ORDERS_TOKEN, **key))
    assert (status, again["first_lsn"], again["replayed"]) == (200, 2, True)
    status, _, reused = await post(http, guarded, other, bearer(ORDERS_TOKEN, **key))
    assert (status, reused["error"], reused["key"]) == (422, "idempotency_key_reused", "shared-key")
    assert "LSN 2..2" in reused["message"]
    status, _, reused = await post(http, guarded, other, bearer(ADMIN_OF_ALL, **key))
    assert (status, reused["error"]) == (422, "idempotency_key_reused")
    assert "LSN 1..1" in reused["message"]
    assert [e.producer for _, _, e in stored(wal)] == ["backfill", "orders-svc"]


async def test_a_window_stored_before_keys_were_scoped_still_answers_an_exact_retry(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Wal
) -> None:
    """A key stored as sent (an open ingest, or a daemon before keys were scoped)
    answers a producer's retry of the same body; another body is a new request."""
    body = ndjson([event(1, collection="orders")])
    key = {"Idempotency-Key": "before-scoping"}
    open_ingest = await start_ingest()
    status, _, first = await post(http, open_ingest, body, {**NDJSON, **key})
    assert (status, first["first_lsn"]) == (200, 1)
    await open_ingest.stop(1.0)
    guarded = await start_ingest(tokens=TOKENS)
    status, _, again = await post(http, guarded, body, bearer(ORDERS_TOKEN, **key))
    assert (status, again["first_lsn"], again["replayed"]) == (200, 1, True)
    other = ndjson([event(2, collection="orders")])
    status, _, new = await post(http, guarded, other, bearer(ORDERS_TOKEN, **key))
    assert (status, new["first_lsn"], new.get("replayed")) == (200, 2, None)
    assert wal.head_lsn() == 2


def test_the_longest_key_config_allows_fits_the_wal_with_its_scope() -> None:
    from daemon.ingest.idempotency import MAX_KEY_BYTES, SCOPE_BYTES, scoped_key
    from wal.format import MAX_REQUEST_KEY_BYTES

    cfg = parse({"ingest": {"max_idempotency_key_bytes": MAX_KEY_BYTES}})
    assert len(scoped_key(b"k" * cfg.ingest.max_idempotency_key_bytes, "p")) == (
        MAX_REQUEST_KEY_BYTES
    )
    with pytest.raises(ConfigError, match="max_idempotency_key_bytes"):
        parse({"ingest": {"max_idempotency_key_bytes": MAX_KEY_BYTES + 1}})
    assert SCOPE_BYTES == 9


async def test_expect_100_continue_without_a_token_is_refused_before_the_body(
    guarded: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    headers = {**NDJSON, "Expect": "100-continue"}
    status, got, body = await post(http, guarded, ndjson([event(1)]), headers)
    assert (status, body["error"]) == (401, "unauthorized")
    assert "WWW-Authenticate" in got
    assert wal.head_lsn() == 0


async def test_without_tokens_ingest_stays_open(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    status, _, _ = await post(http, ingest, ndjson([event(1)]))
    assert status == 200 and wal.head_lsn() == 1


async def test_new_tokens_replace_the_old_ones_for_the_next_request(
    guarded: IngestServer, http: aiohttp.ClientSession, wal: Wal
) -> None:
    guarded.set_tokens((ProducerToken("new", collections=("*",), sha256=sha("new-token")),))
    status, _, _ = await post(http, guarded, ndjson([event(1)]), bearer(ADMIN_OF_ALL))
    assert status == 401
    status, _, _ = await post(http, guarded, ndjson([event(1)]), bearer("new-token"))
    assert status == 200


def test_every_entry_is_compared_with_compare_digest_even_after_a_match() -> None:
    """The time of a look-up does not depend on which entry matched: each entry's
    hash goes through hmac.compare_digest, and the loop does not stop early."""
    auth = security.ProducerAuth(TOKENS)
    with mock.patch.object(security.hmac, "compare_digest", wraps=hmac.compare_digest) as cmp:
        found = auth.by_token(ORDERS_TOKEN)  # the first entry
    assert found is not None and found.name == "orders-svc"
    assert cmp.call_count == len(TOKENS)
    presented = hashlib.sha256(ORDERS_TOKEN.encode()).digest()
    assert {call.args[0] for call in cmp.call_args_list} == {presented}
    assert {call.args[1] for call in cmp.call_args_list} == {
        bytes.fromhex(t.sha256 or "") for t in TOKENS
    }
    with mock.patch.object(security.hmac, "compare_digest", wraps=hmac.compare_digest) as cmp:
        assert auth.by_token("nobody") is None
    assert cmp.call_count == len(TOKENS)


def test_admin_token_check_uses_compare_digest() -> None:
    with mock.patch.object(security.hmac, "compare_digest", wraps=hmac.compare_digest) as cmp:
        assert security.token_matches("admin-secret", sha("admin-secret"))
        assert not security.token_matches("admin-secre", sha("admin-secret"))
    assert cmp.call_count == 2


# -- configuration -------------------------------------------------------------


def test_inline_tokens_parse_with_their_scopes() -> None:
    cfg = parse(
        {
            "ingest": {
                "tokens": [
                    {
                        "name": "orders-svc",
                        "sha256": sha(ORDERS_TOKEN).upper(),
                        "collections": ["orders", "payments"],
                        "collection_prefixes": ["audit."],
                        "max_events_per_s": 20000,
                        "max_bytes_per_s": 16777216,
                    },
                    {"name": "all", "sha256": sha("x"), "collections": "*"},
                ]
            }
        }
    )
    orders, everything = cfg.ingest.tokens
    assert orders.sha256 == sha(ORDERS_TOKEN)
    assert orders.allows("audit.x") and orders.allows("payments") and not orders.allows("audit")
    assert (orders.max_events_per_s, orders.max_bytes_per_s) == (20000, 16777216)
    assert everything.unrestricted and everything.allows("whatever")
    assert sha(ORDERS_TOKEN) not in repr(cfg), "a hash never shows in a repr"


def test_bad_token_entries_are_each_reported_with_their_key_path_and_no_secret() -> None:
    with pytest.raises(ConfigError) as err:
        parse(
            {
                "ingest": {
                    "tokens": [
                        {"name": "a", "sha256": ORDERS_TOKEN, "collections": "*"},
                        {"name": "b", "collections": ["x"]},
                        {"name": "c", "sha256": sha("c")},
                        {"name": "d", "sha256": sha("d"), "collections": [], "scope": 1},
                        {"name": "e", "cert_subject": "CN=e", "collections": "*"},
                        {"name": "f", "sha256": sha("f"), "collections": "*"},
                        {"name": "f", "sha256": sha("f"), "collections": "*"},
                    ]
                },
                "admin": {"token_sha256": "short"},
            }
        )
    text = "\n".join(err.value.errors)
    assert ORDERS_TOKEN not in text
    assert "ingest.tokens[0].sha256: expected the token's SHA-256 as 64 hex digits" in text
    assert "ingest.tokens[1]: needs exactly one of sha256" in text
    assert "ingest.tokens[2].collections: required key is missing" in text
    assert "ingest.tokens[3].collections: expected" in text
    assert "ingest.tokens[3].scope: unknown key" in text
    assert 'producer "e": cert_subject needs ingest.tls_client_ca' in text
    assert 'producer name "f" appears twice' in text
    assert "admin.token_sha256: expected the token's SHA-256" in text


def write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_a_tokens_file_adds_its_entries_to_the_inline_ones(tmp_path: Path) -> None:
    tokens = write_private(
        tmp_path / "tokens.toml",
        f'[[ingest.tokens]]\nname = "from-file"\nsha256 = "{sha("f")}"\ncollections = "*"\n',
    )
    cfg = IngestConfig(tokens_file=tokens, tokens=TOKENS[:1])
    loaded = security.load_tokens(cfg)
    assert [t.name for t in loaded] == ["orders-svc", "from-file"]


def test_a_bad_tokens_file_names_the_file_and_the_entry(tmp_path: Path) -> None:
    tokens = write_private(
        tmp_path / "tokens.toml",
        f'[[ingest.tokens]]\nname = "orders-svc"\nsha256 = "{sha("z")}"\ncollections = "*"\n'
        '[[ingest.tokens]]\nname = "x"\ncollections = "*"\n'
        "[ingest]\nlisten = 1\n",
    )
    with pytest.raises(ConfigError) as err:
        security.load_tokens(IngestConfig(tokens_file=tokens, tokens=TOKENS[:1]))
    text = "\n".join(err.value.errors)
    assert f"{tokens}: ingest.listen: unknown key" in text
    assert f"{tokens}: ingest.tokens[1]: needs exactly one of sha256" in text
    missing = IngestConfig(tokens_file=tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"ingest\.tokens_file: file not found"):
        security.load_tokens(missing)


def test_a_cert_subject_in_the_tokens_file_needs_a_client_ca(tmp_path: Path) -> None:
    tokens = write_private(
        tmp_path / "tokens.toml",
        '[[ingest.tokens]]\nname = "c"\ncert_subject = "CN=c"\ncollections = "*"\n',
    )
    with pytest.raises(
        ConfigError, match=r'producer "c": cert_subject needs ingest\.tls_client_ca'
    ):
        security.load_tokens(IngestConfig(tokens_file=tokens))


def test_the_same_name_in_the_file_and_inline_is_refused(tmp_path: Path) -> None:
    tokens = write_private(
        tmp_path / "tokens.toml",
        f'[[ingest.tokens]]\nname = "orders-svc"\nsha256 = "{sha("z")}"\ncollections = "*"\n',
    )
    with pytest.raises(ConfigError, match=r'producer name "orders-svc" appears twice'):
        security.load_tokens(IngestConfig(tokens_file=tokens, tokens=TOKENS[:1]))


def test_an_open_listener_off_loopback_is_warned_about() -> None:
    def warnings(ingest_host: str, tokens: tuple[ProducerToken, ...] = ()) -> list[str]:
        cfg = Config(ingest=IngestConfig(listen=Listen(ingest_host, 8470)))
        return [name for name, _ in security.open_warnings(cfg, security.ProducerAuth(tokens))]

    assert warnings("127.0.0.1") == []
    assert warnings("0.0.0.0") == ["security.ingest_open"]
    assert warnings("0.0.0.0", TOKENS) == []


def test_bearer_header_forms() -> None:
    cases: dict[Any, Any] = {
        None: None,
        "": None,
        "Bearer abc": "abc",
        "bearer   abc ": "abc",
        "Basic abc": None,
        "Bearer": None,
    }
    assert {k: security.bearer_token(k) for k in cases} == cases


async def test_each_stored_event_names_the_producer_whose_token_sent_it(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Wal
) -> None:
    """Who wrote it: an authenticated request's events are stored with the
    token entry's name (the 11-field form), event id and time kept; an open
    ingest stores none."""
    guarded = await start_ingest(tokens=TOKENS)
    batch = [event(1), event(2, collection="payments", id="evt-2", time=1_700_000_000_000)]
    status, _, _ = await post(http, guarded, ndjson(batch), bearer(ORDERS_TOKEN))
    assert status == 200
    status, _, _ = await post(
        http, guarded, ndjson([event(3, collection="audit.x")]), bearer(AUDIT_TOKEN)
    )
    assert status == 200
    got = {e.key: e for _, _, e in stored(wal)}
    assert {k: e.producer for k, e in got.items()} == {
        "k1": "orders-svc", "k2": "orders-svc", "k3": "auditor",
    }  # fmt: skip
    assert got["k2"].event_id == "evt-2" and got["k2"].event_time_us == 1_700_000_000_000_000
    assert [r.payload[0] for r in wal.read(1)] == [0x9B, 0x9B, 0x9B]


async def test_an_open_ingest_stores_events_without_a_producer(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Wal
) -> None:
    server = await start_ingest()
    status, _, _ = await post(http, server, ndjson([event(1)]))
    assert status == 200
    assert [e.producer for _, _, e in stored(wal)] == [None]
    assert [r.payload[0] for r in wal.read(1)] == [0x98]  # the short form, as before
