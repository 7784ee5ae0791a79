"""Who may reach the daemon: TLS contexts, producer tokens, the admin token.

- :func:`load_tokens`: every ``[[ingest.tokens]]`` entry, inline and from
  ``ingest.tokens_file``, checked whole (:class:`ConfigError` lists each problem).
- :class:`ProducerAuth`: a request's producer, from its bearer token (SHA-256,
  compared with :func:`hmac.compare_digest` against every entry, so the time
  taken says nothing of which entry, or which bytes, matched) or from its
  verified TLS client certificate's subject.
- :class:`ServerTls`: a listener's SSL context. :meth:`ServerTls.reload` swaps
  in a context built from the files as they are now; handshakes from then on
  use it (an SNI callback picks it), connections already open keep theirs.
- :func:`check_secret_files`: ``check-config``'s look at the files.

A token or its hash never goes to a log, an error or ``/v1/status``: at most
its producer's name. docs/security.md is the user's page.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import ssl
import stat
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from daemon.config import (
    ENV_CREDENTIALS,
    AdminConfig,
    Config,
    IngestConfig,
    ProducerToken,
    TlsConfig,
    check_token_set,
    parse_tokens,
)
from daemon.errors import ConfigError

BEARER = "bearer"
# RFC 6750's challenge; the realm names the listener.
CHALLENGE_INGEST = 'Bearer realm="eventplane-ingest"'
CHALLENGE_ADMIN = 'Bearer realm="eventplane-admin"'
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
# Permission bits a secret file must not have: readable by its group or by anyone.
SECRET_MODE_BITS = stat.S_IRGRP | stat.S_IROTH


def digest_of(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != BEARER or not token:
        return None
    return token


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def _unset_credentials(path: Path) -> str:
    if ENV_CREDENTIALS in str(path):
        return (
            f" (${ENV_CREDENTIALS} is not set: systemd sets it for a unit with "
            "LoadCredential=; to check the files by hand, set it to the folder holding "
            "them, docs/security.md)"
        )
    return ""


# -- the producers -----------------------------------------------------------


def load_tokens(ingest: IngestConfig) -> tuple[ProducerToken, ...]:
    """The inline entries and ``tokens_file``'s, checked together (unique names and
    hashes). Read at start and on SIGHUP; raises ConfigError with every problem."""
    tokens = ingest.tokens
    path = ingest.tokens_file
    if path is None:
        return tokens
    errors: list[str] = []
    raw = _read_toml(path, "ingest.tokens_file", errors)
    if raw is not None:
        where = f"{path}: ingest.tokens"
        for key, value in raw.items():
            if key != "ingest" or not isinstance(value, dict):
                errors.append(f"{path}: {key}: unknown key (a tokens file holds [[ingest.tokens]])")
                continue
            for sub in value:
                if sub != "tokens":
                    errors.append(f"{path}: ingest.{sub}: unknown key (only [[ingest.tokens]])")
            tokens = tokens + parse_tokens(value.get("tokens", []), where, errors)
    if not errors:
        check_token_set(tokens, f"ingest.tokens and {path}", errors)
        if ingest.tls.client_ca is None:
            errors += [
                f'{path}: producer "{t.name}": cert_subject needs ingest.tls_client_ca'
                for t in tokens
                if t.cert_subject is not None
            ]
    if errors:
        raise ConfigError(errors, str(path))
    return tokens


def _read_toml(path: Path, key: str, errors: list[str]) -> dict[str, Any] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        errors.append(f"{key}: file not found: {path}{_unset_credentials(path)}")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        errors.append(f"{key}: cannot read {path} ({getattr(exc, 'strerror', None) or exc})")
        return None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        errors.append(f"{key}: {path} is not valid TOML ({exc})")
        return None


class ProducerAuth:
    """Producer entries by token digest and by certificate subject."""

    __slots__ = ("_digests", "_subjects", "tokens")

    def __init__(self, tokens: tuple[ProducerToken, ...]) -> None:
        self.tokens = tokens
        self._digests = [(bytes.fromhex(t.sha256), t) for t in tokens if t.sha256 is not None]
        self._subjects = {t.cert_subject: t for t in tokens if t.cert_subject is not None}

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def by_token(self, token: str) -> ProducerToken | None:
        """The entry whose hash is the token's. Every entry is compared, in constant
        time each, and the loop does not stop at a match."""
        digest = digest_of(token)
        found: ProducerToken | None = None
        for expected, entry in self._digests:
            if hmac.compare_digest(digest, expected):
                found = entry
        return found

    def by_certificate(self, peercert: Mapping[str, Any] | None) -> ProducerToken | None:
        """The entry naming a verified client certificate's subject."""
        if not peercert or not self._subjects:
            return None
        return self._subjects.get(subject_string(peercert))


def token_matches(token: str | None, sha256_hex: str) -> bool:
    """Whether ``token`` hashes to ``sha256_hex``, compared in constant time."""
    if token is None:
        return False
    return hmac.compare_digest(digest_of(token), bytes.fromhex(sha256_hex))


# A certificate's attribute names as OpenSSL's RFC 2253 output shortens them.
_SHORT_NAMES = {
    "commonName": "CN",
    "countryName": "C",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "streetAddress": "street",
    "domainComponent": "DC",
    "userId": "UID",
}
_RFC2253_SPECIAL = frozenset(',+"\\<>;')


def _escape(value: str) -> str:
    out = "".join("\\" + c if c in _RFC2253_SPECIAL else c for c in value)
    if out.startswith(("#", " ")):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out


def subject_string(peercert: Mapping[str, Any]) -> str:
    """A certificate's subject as ``openssl x509 -noout -subject -nameopt RFC2253``
    prints it (most specific first: ``CN=orders-svc,O=Acme``)."""
    rdns = peercert.get("subject") or ()
    return ",".join(
        "+".join(f"{_SHORT_NAMES.get(k, k)}={_escape(v)}" for k, v in rdn) for rdn in reversed(rdns)
    )


# -- TLS -----------------------------------------------------------------------


def _no_passphrase() -> bytes:
    raise ValueError("the key is encrypted: give the daemon an unencrypted key file (mode 0600)")


def server_context(tls: TlsConfig, section: str) -> ssl.SSLContext:
    """A listener's context: TLS 1.2 or newer, Python's default ciphers; with a
    client CA, a client without a certificate it signed fails the handshake."""
    if tls.cert is None or tls.key is None:
        raise ConfigError([f"{section}.tls_cert: not set"], section)
    errors: list[str] = []
    for key, path in (
        ("tls_cert", tls.cert),
        ("tls_key", tls.key),
        ("tls_client_ca", tls.client_ca),
    ):
        if path is not None and not path.is_file():
            errors.append(f"{section}.{key}: file not found: {path}{_unset_credentials(path)}")
    if errors:
        raise ConfigError(errors, section)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert, tls.key, password=_no_passphrase)
    except (OSError, ValueError, ssl.SSLError) as exc:
        raise ConfigError(
            [
                f"{section}.tls_cert, {section}.tls_key: cannot use {tls.cert} with "
                f"{tls.key}: {exc} (PEM files; the key must be the certificate's)"
            ],
            section,
        ) from exc
    if tls.client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=str(tls.client_ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                [f"{section}.tls_client_ca: cannot load {tls.client_ca}: {exc} (PEM)"], section
            ) from exc
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ServerTls:
    """The context a listener holds, and the one its new handshakes use.

    The listener keeps :attr:`context` for its life; its SNI callback, which
    OpenSSL runs for every ClientHello (with or without a server name), moves
    the handshake to the newest context. Connections already open keep the
    one they shook hands with. Whether a client certificate is required is
    the listener's for its life: adding or removing ``tls_client_ca`` needs
    a restart; a new CA file takes effect on reload.
    """

    __slots__ = ("_current", "context", "section", "tls")

    def __init__(self, tls: TlsConfig, section: str) -> None:
        self.section = section
        self.tls = tls
        self.context = server_context(tls, section)
        self._current = self.context
        self.context.sni_callback = self._pick

    def _pick(self, conn: Any, server_name: str | None, ctx: ssl.SSLContext) -> None:
        current = self._current
        if current is not ctx:
            conn.context = current

    def reload(self, tls: TlsConfig) -> None:
        """Build a context from ``tls``'s files now and use it for new handshakes; on
        any problem raise ConfigError and keep the current one."""
        self.prepare(tls)()

    def prepare(self, tls: TlsConfig) -> Callable[[], None]:
        """Build a context from ``tls``'s files now (ConfigError on any problem); the
        returned call makes new handshakes use it."""
        if (tls.client_ca is None) != (self.tls.client_ca is None):
            raise ConfigError(
                [
                    f"{self.section}.tls_client_ca: turning client certificates on or off "
                    "needs a restart"
                ],
                self.section,
            )
        context = server_context(tls, self.section)

        def apply() -> None:
            self._current = context
            self.tls = tls

        return apply


def client_context(
    ca_file: Path | str | None = None,
    cert: Path | str | None = None,
    key: Path | str | None = None,
) -> ssl.SSLContext:
    """A client's context: the system's CAs, or ``ca_file``'s (a private CA);
    ``cert``/``key`` for a listener that asks for a client certificate."""
    ctx = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        ctx.load_cert_chain(str(cert), None if key is None else str(key))
    return ctx


def read_token_file(path: Path | str) -> str:
    """A bearer token kept in a file (first line, surrounding blanks dropped)."""
    text = Path(path).read_text(encoding="utf-8")
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise ValueError(f"{path}: the token file is empty")
    return token


# -- check-config ------------------------------------------------------------


def check_secret_files(cfg: Config) -> list[str]:
    """Each TLS file and the tokens file: it exists, parses, and a secret (a key,
    the tokens file) is not readable by its group or by everyone."""
    problems: list[str] = []
    for section, listener in (("ingest", cfg.ingest), ("admin", cfg.admin)):
        tls = listener.tls
        if tls.enabled:
            problems += _secret_mode(f"{section}.tls_key", tls.key)
            try:
                server_context(tls, section)
            except ConfigError as exc:
                problems += exc.errors
    if cfg.ingest.tokens_file is not None:
        problems += _secret_mode("ingest.tokens_file", cfg.ingest.tokens_file)
        try:
            load_tokens(cfg.ingest)
        except ConfigError as exc:
            problems += exc.errors
    return problems


def _secret_mode(key: str, path: Path | None) -> list[str]:
    if path is None:
        return []
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return []  # the load that follows says what is wrong with it
    if mode & SECRET_MODE_BITS:
        return [
            f"{key}: {path} is readable by its group or by everyone (mode "
            f"{stat.S_IMODE(mode):04o}): chmod 600 it, owned by the daemon's user, or "
            "load it with systemd's LoadCredential= (docs/security.md)"
        ]
    return []


def open_warnings(cfg: Config, producers: ProducerAuth) -> list[tuple[str, dict[str, Any]]]:
    """Start-up warnings for a listener anyone who reaches it may use."""
    out: list[tuple[str, dict[str, Any]]] = []
    ing = cfg.ingest
    if not producers.enabled and ing.tls.client_ca is None and not is_loopback(ing.listen.host):
        out.append(
            (
                "security.ingest_open",
                {
                    "listen": str(ing.listen),
                    "message": "no [[ingest.tokens]]: anyone who reaches this address may "
                    "write any collection (docs/security.md)",
                },
            )
        )
    adm: AdminConfig = cfg.admin
    if adm.token_sha256 is None and adm.tls.client_ca is None and not is_loopback(adm.listen.host):
        out.append(
            (
                "security.admin_open",
                {
                    "listen": str(adm.listen),
                    "message": "no [admin] token_sha256: anyone who reaches this address may "
                    "pause stages and start compactions (docs/security.md)",
                },
            )
        )
    return out
