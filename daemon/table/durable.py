"""Durable file writes of the CDC tables' own files (ledger, intents, quarantine).

Below :mod:`daemon.table.parquet` and its neighbours, which all take these from
here: a write is durable once its bytes and the folder entry naming it were
fsynced, and a reader finds either the old file or the new one, never a part.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from wal.files import fsync_dir

__all__ = ["append_line", "atomic_write_json", "fsync_dir", "fsync_file"]


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` so that ``path`` holds either the old or the new text, durably."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def append_line(path: Path, obj: Any) -> None:
    """Append ``obj`` as one JSON line to ``path`` and fsync it (and a new file's folder)."""
    new = not path.exists()
    data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode() + b"\n"
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if new:
        fsync_dir(path.parent)
