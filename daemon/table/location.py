"""Where a Delta stream's table files live: a folder on the daemon's disk
(:class:`LocalFiles`) or a prefix in an S3 bucket (:class:`S3Files`).

The Delta sink (``daemon/table/delta.py``) stages a batch's Parquet files on
local disk and then asks its location to:

- put them under their final names (on disk the sink renames them into the
  partition folders; :meth:`S3Files.upload` uploads them, multipart above
  8 MiB);
- ``remove`` files no commit lists (a failed commit's, a crash's orphans);
- ``published`` the ``part-b<B>-*`` files there are (recovery);
- ``log_versions`` / ``read_log`` the commit files of ``_delta_log``;
- ``sync_log`` new log entries (fsync on disk; nothing on S3, whose PUT is
  durable when it answers).

delta-rs opens the table at ``uri`` with ``storage_options``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from daemon.config import CdcStream, S3Config
from daemon.table.durable import fsync_dir, fsync_file
from daemon.table.layout import _PUBLISHED, _published
from daemon.table.s3 import Location, client, storage_options

LOG_DIR = "_delta_log"
COMMIT_FILE = re.compile(r"^(\d{20})\.json$")


class TableFiles(Protocol):
    uri: str
    storage_options: dict[str, str] | None
    remote: bool

    def remove(self, rels: list[str]) -> None: ...

    def published(self) -> list[tuple[int, str]]: ...

    def log_versions(self, after: int) -> list[int]: ...

    def read_log(self, version: int) -> bytes: ...

    def sync_log(self, versions: range) -> None: ...


class LocalFiles:
    """The table in a folder on the daemon's disk."""

    remote = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = str(root)
        self.storage_options: dict[str, str] | None = None

    def remove(self, rels: list[str]) -> None:
        for rel in rels:
            (self.root / rel).unlink(missing_ok=True)

    def published(self) -> list[tuple[int, str]]:
        return [(b, f.relative_to(self.root).as_posix()) for b, f in _published(self.root)]

    def log_versions(self, after: int) -> list[int]:
        log_dir = self.root / LOG_DIR
        if not log_dir.is_dir():
            return []
        found = (COMMIT_FILE.match(p.name) for p in log_dir.iterdir())
        return sorted(v for m in found if m and (v := int(m.group(1))) > after)

    def read_log(self, version: int) -> bytes:
        return (self.root / LOG_DIR / f"{version:020d}.json").read_bytes()

    def sync_log(self, versions: range) -> None:
        log_dir = self.root / LOG_DIR
        for version in versions:
            entry = log_dir / f"{version:020d}.json"
            if entry.exists():
                fsync_file(entry)
        fsync_dir(log_dir)


class S3Files:
    """The table under an S3 prefix (``s3://bucket/prefix``)."""

    remote = True

    def __init__(self, uri: str, cfg: S3Config) -> None:
        self.where = Location.parse(uri)
        self.cfg = cfg
        self.uri = self.where.uri
        self.storage_options: dict[str, str] | None = storage_options(cfg)
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = client(self.cfg)
        return self._client

    def upload(self, staging: Path, files: list[tuple[str, str]]) -> None:
        """Put the staged files under their final names (boto3's upload_file:
        one PUT up to 8 MiB, a multipart upload above)."""
        for rel, final in files:
            self.client.upload_file(str(staging / rel), self.where.bucket, self.where.key(final))

    def remove(self, rels: list[str]) -> None:
        for i in range(0, len(rels), 1000):
            chunk = [{"Key": self.where.key(r)} for r in rels[i : i + 1000]]
            self.client.delete_objects(
                Bucket=self.where.bucket, Delete={"Objects": chunk, "Quiet": True}
            )

    def _keys(self, under: str, start_after: str = "") -> Iterator[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.where.bucket, Prefix=self.where.key(under), StartAfter=start_after
        )
        for page in pages:
            for item in page.get("Contents", []):
                yield str(item["Key"])

    def published(self) -> list[tuple[int, str]]:
        out = []
        for key in self._keys(""):
            rel = self.where.rel(key)
            parts = rel.split("/")
            if len(parts) < 2 or any(p.startswith(("_", ".")) for p in parts[:-1]):
                continue
            m = _PUBLISHED.match(parts[-1])
            if m:
                out.append((int(m.group(1)), rel))
        return out

    def log_versions(self, after: int) -> list[int]:
        start = self.where.key(f"{LOG_DIR}/{after:020d}.json") if after >= 0 else ""
        found = (COMMIT_FILE.match(k.rsplit("/", 1)[-1]) for k in self._keys(f"{LOG_DIR}/", start))
        return sorted(v for m in found if m and (v := int(m.group(1))) > after)

    def read_log(self, version: int) -> bytes:
        key = self.where.key(f"{LOG_DIR}/{version:020d}.json")
        return bytes(self.client.get_object(Bucket=self.where.bucket, Key=key)["Body"].read())

    def sync_log(self, versions: range) -> None:
        """An S3 PUT is durable when it answers: nothing to do."""


def table_files(stream: CdcStream) -> TableFiles:
    """The location of ``stream``'s table."""
    if stream.uri:
        return S3Files(stream.uri, stream.s3 or S3Config())
    return LocalFiles(Path(stream.path))
