"""``eventplane check-config`` looks at the TLS files and the tokens file: each exists,
parses, and a secret is not readable by its group or by everyone."""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path

import pytest

from daemon.cli import checkconfig
from daemon.config import load
from tests.ingest.certs import Pki


def setup(tmp_path: Path, pki: Pki, *, creds: str = "") -> Path:
    secrets = tmp_path / "credentials"
    secrets.mkdir()
    for src, name in ((pki.server_crt, "ingest.crt"), (pki.server_key, "ingest.key")):
        shutil.copy(src, secrets / name)
    (secrets / "ca.crt").write_bytes(pki.ca.read_bytes())
    digest = hashlib.sha256(b"t").hexdigest()
    tokens = secrets / "tokens.toml"
    tokens.write_text(f'[[ingest.tokens]]\nname = "a"\nsha256 = "{digest}"\ncollections = "*"\n')
    for f in secrets.iterdir():
        f.chmod(0o600)
    prefix = creds or "credentials"
    config = tmp_path / "config.toml"
    config.write_text(
        "[ingest]\n"
        f'tls_cert = "{prefix}/ingest.crt"\ntls_key = "{prefix}/ingest.key"\n'
        f'tls_client_ca = "{prefix}/ca.crt"\ntokens_file = "{prefix}/tokens.toml"\n'
    )
    return config


def check(config: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = checkconfig.main(load(config), spark=False, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_private_readable_files_that_parse_are_ok(tmp_path: Path, pki: Pki) -> None:
    code, out, err = check(setup(tmp_path, pki))
    assert (code, err) == (0, "")
    assert out.startswith("OK ")


def test_a_group_readable_key_and_tokens_file_fail_with_the_fix(tmp_path: Path, pki: Pki) -> None:
    config = setup(tmp_path, pki)
    (tmp_path / "credentials/ingest.key").chmod(0o640)
    (tmp_path / "credentials/tokens.toml").chmod(0o644)
    code, _, err = check(config)
    assert code == 2
    assert "2 error(s)" in err
    assert "ingest.tls_key: " in err and "(mode 0640): chmod 600 it" in err
    assert "ingest.tokens_file: " in err and "(mode 0644)" in err


def test_a_missing_file_a_bad_certificate_and_a_bad_tokens_file_are_each_named(
    tmp_path: Path, pki: Pki
) -> None:
    config = setup(tmp_path, pki)
    (tmp_path / "credentials/ca.crt").unlink()
    (tmp_path / "credentials/ingest.crt").write_text("not a certificate\n")
    (tmp_path / "credentials/tokens.toml").write_text("[[ingest.tokens]]\nname = 1\n")
    code, _, err = check(config)
    assert code == 2
    assert "ingest.tls_client_ca: file not found: " in err
    assert "tokens.toml: ingest.tokens[0].name: expected a non-empty string, got 1" in err
    (tmp_path / "credentials/ca.crt").write_bytes(pki.ca.read_bytes())
    code, _, err = check(config)
    assert "ingest.tls_cert, ingest.tls_key: cannot use" in err


def test_credentials_directory_names_the_folder_of_loadcredential_files(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = setup(tmp_path, pki, creds="${CREDENTIALS_DIRECTORY}")
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    code, _, err = check(config)
    assert code == 2
    assert "$CREDENTIALS_DIRECTORY is not set: systemd sets it" in err
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "credentials"))
    assert check(config)[0] == 0
