"""A private PKI for TLS tests, made with the ``openssl`` command (EC P-256: fast).

Two CAs; a server certificate for 127.0.0.1/localhost from each (rotation);
client certificates: a good one, an expired one, and one from the other CA.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests import requires

CLIENT_SUBJECT = "CN=orders-svc,O=Acme"  # as `openssl x509 -subject -nameopt RFC2253` prints it


@dataclass(frozen=True)
class Pki:
    ca: Path
    ca2: Path
    server_crt: Path
    server_key: Path
    server2_crt: Path  # signed by ca2: a rotation to another CA
    server2_key: Path
    client_crt: Path
    client_key: Path
    expired_crt: Path
    expired_key: Path
    stranger_crt: Path  # a client certificate signed by ca2
    stranger_key: Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _key_and_csr(d: Path, name: str, subject: str, san: str | None = None) -> None:
    args = ["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    args += ["-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject]
    if san:
        args += ["-addext", f"subjectAltName={san}"]
    _run(*args, cwd=d)
    (d / f"{name}.key").chmod(0o600)


def _sign(d: Path, name: str, ca: str, days: int) -> None:
    _run(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", str(days), "-copy_extensions", "copy",
        cwd=d,
    )  # fmt: skip


def make_pki(d: Path) -> Pki:
    """``days = -1`` puts notAfter in the past: an expired certificate."""
    requires.command("openssl", "Debian package `openssl` (.ci/run installs it)")
    d.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "ca2"):
        _run(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
            "-subj", f"/CN=eventplane test {ca}",
            cwd=d,
        )  # fmt: skip
    san = "IP:127.0.0.1,DNS:localhost"
    for name, ca, subject, days in (
        ("server", "ca", "/CN=localhost", 2),
        ("server2", "ca2", "/CN=localhost", 2),
        ("client", "ca", "/O=Acme/CN=orders-svc", 2),
        ("expired", "ca", "/O=Acme/CN=orders-svc", -1),
        ("stranger", "ca2", "/O=Acme/CN=orders-svc", 2),
    ):
        _key_and_csr(d, name, subject, san if name.startswith("server") else None)
        _sign(d, name, ca, days)
    return Pki(
        d / "ca.crt",
        d / "ca2.crt",
        *(d / f"{n}.{ext}" for n in ("server", "server2") for ext in ("crt", "key")),
        *(d / f"{n}.{ext}" for n in ("client", "expired", "stranger") for ext in ("crt", "key")),
    )
