"""A stream's table on S3 in the config (``path = "s3://..."``, ``[s3]``), the
credentials' sources, and ``check-config`` saying in one line what is wrong
with reaching the bucket (against the real server of tests/s3/server.py)."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest

from daemon.cli import checkconfig
from daemon.config import S3Config, parse
from daemon.errors import ConfigError
from daemon.table import s3
from tests import requires
from tests.conftest import free_port
from tests.s3.server import S3Server

pytestmark = pytest.mark.timeout(120)


def stream(path: str, **keys: object) -> dict[str, object]:
    return {"name": "orders", "collections": "*", "path": path, "format": "delta", **keys}


def test_an_s3_stream_keeps_its_state_under_the_data_dir_and_its_table_in_the_bucket(
    tmp_path: Path,
) -> None:
    cfg = parse(
        {
            "daemon": {"data_dir": "var"},
            "s3": {"endpoint": "http://127.0.0.1:9000", "credentials_file": "secrets/s3"},
            "cdc": {"streams": [stream("s3a://lake/cdc/orders")]},
        },
        tmp_path / "config.toml",
    )
    (s,) = cfg.cdc.streams
    assert s.uri == "s3a://lake/cdc/orders" and s.location == "s3a://lake/cdc/orders"
    assert s.path == tmp_path / "var" / "tables" / "orders"
    assert s.s3 is not None and s.s3.credentials_file == tmp_path / "secrets" / "s3"
    assert s3.Location.parse(s.uri) == s3.Location("lake", "cdc/orders")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"cdc": {"streams": [stream("s3://lake/x", format="parquet")]}},
         r'cdc.streams\[0\].path: a table on S3 .* must be a Delta table .*not format = "parquet"'),
        ({"cdc": {"streams": [stream("s3://lake/x", variant=True)]}},
         r"cdc.streams\[0\].path: .*not variant = true"),
        ({"cdc": {"streams": [stream("s3:///x")]}}, r'expected "s3://bucket/prefix"'),
        ({"s3": {"lease_ttl_s": 8, "lease_skew_s": 5}}, r"s3.lease_ttl_s: must exceed twice"),
        ({"s3": {"request_timeout_s": 30}},
         r"s3.request_timeout_s: .*request_timeout_s 30\) x .* = 96 s, must be shorter than "
         r"the lease window, lease_ttl_s - lease_skew_s = 25 s: no S3 request of a commit"),
        ({"s3": {"access_key_id": "AKIA"}}, r"s3.access_key_id: set both"),
        ({"s3": {"bucket": "x"}}, r"s3.bucket: unknown key"),
    ],
)  # fmt: skip
def test_an_s3_setting_that_cannot_work_is_refused_with_its_key(
    raw: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(raw)


def test_secrets_stay_out_of_the_config_repr() -> None:
    cfg = S3Config(access_key_id="AKIAEXAMPLE", secret_access_key="very-secret")
    assert "very-secret" not in repr(cfg) and "AKIAEXAMPLE" not in repr(cfg)


def test_credentials_come_from_the_config_then_the_file_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    file = tmp_path / "s3"
    file.write_text("[default]\naws_access_key_id = file-key\naws_secret_access_key = fs\n")
    inline = S3Config(access_key_id="cfg-key", secret_access_key="cs", credentials_file=file)
    assert s3.credentials(inline).access_key_id == "cfg-key"  # type: ignore[union-attr]
    from_file = s3.credentials(S3Config(credentials_file=file))
    assert from_file is not None and from_file.access_key_id == "file-key"
    assert str(file) in from_file.source
    from_env = s3.credentials(S3Config())
    assert from_env is not None and from_env.access_key_id == "env-key"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert s3.credentials(S3Config()) is None
    with pytest.raises(s3.S3Error, match=r"has no \[ci\] profile"):
        s3.credentials(S3Config(credentials_file=file, profile="ci"))
    with pytest.raises(s3.S3Error, match="cannot read"):
        s3.credentials(S3Config(credentials_file=tmp_path / "missing"))


def _check(cfg: S3Config, uri: str) -> tuple[int, str]:
    parsed = parse({"cdc": {"streams": [stream(uri)]}}, Path("/etc/eventplane/config.toml"))
    parsed = replace(
        parsed,
        cdc=replace(parsed.cdc, streams=(replace(parsed.cdc.streams[0], s3=cfg),)),
    )
    err = io.StringIO()
    code = checkconfig.main(parsed, spark=False, out=io.StringIO(), err=err)
    return code, err.getvalue()


def test_check_config_reaches_the_bucket_or_says_what_is_wrong_in_one_line(
    s3_server: S3Server,
) -> None:
    requires.delta_jars()  # check-config refuses a Delta stream without them first
    good = s3_server.config()
    assert _check(good, f"s3://{s3_server.bucket}/cdc/orders") == (0, "")

    code, err = _check(good, "s3://no-such-bucket/cdc/orders")
    assert code == 2 and "bucket 'no-such-bucket' does not exist" in err, err
    code, err = _check(replace(good, secret_access_key="s3cr3t-value"), "s3://lake/cdc/orders")
    assert code == 2 and "refused the credentials from [s3] access_key_id" in err, err
    assert "s3cr3t-value" not in err
    down = replace(good, endpoint=f"http://127.0.0.1:{free_port()}", max_retries=0)
    code, err = _check(down, "s3://lake/cdc/orders")
    assert code == 2 and "cannot reach http://127.0.0.1" in err, err
    assert all(len(line) < 300 for line in err.splitlines()) and err.count("\n") == 1


def test_the_server_refuses_a_second_conditional_create(s3_server: S3Server) -> None:
    """What a table on S3 needs of the store (checked at each stream's open)."""
    where = s3.Location(s3_server.bucket, "probe-cond")
    assert s3.refuses_second_create(s3_server.client(), where) is None
