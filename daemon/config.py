"""Configuration: loaded once, validated whole, frozen.

Every problem is collected with its key path before anything starts, so an
operator fixes a file in one pass::

    wal.segment_bytes: expected an integer >= 1 MiB, got "big"
    ingest.listen: expected "host:port", got "8470"
    triggers[1].name: duplicate trigger name "big-orders" (also triggers[0])

Sections, keys and defaults are a contract with users: docs/configuration.md,
"Every key" documents each one (tests/test_config_docs.py compares it with the
tables here), the top-level ``config.toml`` the common ones.
The sections' dataclasses are in :mod:`daemon.configtypes`; import them from here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from daemon.configtypes import (
    ALLOW_DUPLICATE_KEYS,
    MAX_EVENT_BYTES,
    MAX_JSON_DEPTH,
    MIRROR_TYPES,
    OPS,
    AdminConfig,
    CdcConfig,
    CdcHandler,
    CdcMirror,
    CdcStream,
    Config,
    ConsumerConfig,
    DaemonConfig,
    DlqConfig,
    FsyncMode,
    GiB,
    HealthConfig,
    IngestConfig,
    KiB,
    Listen,
    LogConfig,
    LogFormat,
    LogLevel,
    MiB,
    MicrobatchConfig,
    Op,
    ProducerToken,
    RetentionMode,
    RetryPolicy,
    S3Config,
    SparkConfig,
    TlsConfig,
    TriggerSpec,
    WalArchiveConfig,
    WalConfig,
)
from daemon.errors import ConfigError

__all__ = [
    "ACTION_TYPES",
    "ALLOW_DUPLICATE_KEYS",
    "ENV_CONFIG",
    "ENV_CREDENTIALS",
    "HISTORY_COLUMNS",
    "MAX_EVENT_BYTES",
    "MAX_JSON_DEPTH",
    "MIRROR_COLUMNS",
    "MIRROR_TYPES",
    "OPS",
    "PARTITION_LAYOUTS",
    "SECTIONS",
    "AdminConfig",
    "CdcConfig",
    "CdcHandler",
    "CdcMirror",
    "CdcStream",
    "Checker",
    "Config",
    "ConsumerConfig",
    "DaemonConfig",
    "DlqConfig",
    "FsyncMode",
    "GiB",
    "HealthConfig",
    "IngestConfig",
    "KiB",
    "Listen",
    "LogConfig",
    "LogFormat",
    "LogLevel",
    "MiB",
    "MicrobatchConfig",
    "Op",
    "ProducerToken",
    "RetentionMode",
    "RetryPolicy",
    "S3Config",
    "SparkConfig",
    "TlsConfig",
    "TriggerSpec",
    "WalArchiveConfig",
    "WalConfig",
    "check_token_set",
    "credential_path",
    "default_path",
    "load",
    "parse",
    "parse_retention",
    "parse_tokens",
    "parse_triggers",
]


# --------------------------------------------------------------------------
# Validation: a checker takes (value, path, errors) and returns the converted
# value or None after appending a message to ``errors``.

Checker = Callable[[Any, str, list[str]], Any]


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return repr(value)


def _int(
    minimum: int | None = None, maximum: int | None = None, unit: str = "", why: str = ""
) -> Checker:
    """An integer within bounds; ``why`` says why the bounds are what they are."""

    def describe() -> str:
        bound = ""
        if minimum is not None:
            shown = f"{minimum // MiB} MiB" if unit == "bytes" and minimum >= MiB else str(minimum)
            bound = f" >= {shown}"
        if maximum is not None:
            bound += f" <= {maximum}" if not bound else f" and <= {maximum}"
        if why:
            bound += f" ({why})"
        return f"an integer{bound}"

    def check(value: Any, path: str, errors: list[str]) -> Any:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and minimum is not None and value < minimum:
            ok = False
        if ok and maximum is not None and value > maximum:
            ok = False
        if not ok:
            errors.append(f"{path}: expected {describe()}, got {_show(value)}")
            return None
        return value

    return check


def _float(minimum: float = 0.0, exclusive: bool = True) -> Checker:
    def check(value: Any, path: str, errors: list[str]) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            errors.append(f"{path}: expected a number, got {_show(value)}")
            return None
        if value < minimum or (exclusive and value == minimum):
            op = ">" if exclusive else ">="
            errors.append(f"{path}: expected a number {op} {minimum:g}, got {value!r}")
            return None
        return float(value)

    return check


def _bool(value: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(value, bool):
        errors.append(f"{path}: expected true or false, got {_show(value)}")
        return None
    return value


def _str(nonempty: bool = True) -> Checker:
    def check(value: Any, path: str, errors: list[str]) -> Any:
        if not isinstance(value, str) or (nonempty and not value.strip()):
            what = "a non-empty string" if nonempty else "a string"
            errors.append(f"{path}: expected {what}, got {_show(value)}")
            return None
        return value

    return check


def _choice(*choices: str) -> Checker:
    def check(value: Any, path: str, errors: list[str]) -> Any:
        if value not in choices:
            shown = " | ".join(f'"{c}"' for c in choices)
            errors.append(f"{path}: expected one of {shown}, got {_show(value)}")
            return None
        return value

    return check


def _listen(value: Any, path: str, errors: list[str]) -> Any:
    if isinstance(value, str) and ":" in value:
        host, _, port_s = value.rpartition(":")
        host = host.strip("[]")
        if host and port_s.isdigit() and 0 <= int(port_s) <= 65535:
            return Listen(host, int(port_s))
    errors.append(f'{path}: expected "host:port" (port 0-65535), got {_show(value)}')
    return None


def _path(value: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(value, str) or not value.strip():
        errors.append(f"{path}: expected a path string, got {_show(value)}")
        return None
    return Path(value)


def _table_path(value: Any, path: str, errors: list[str]) -> Any:
    """A folder, or an ``s3://bucket/prefix`` URI (kept as a string)."""
    if isinstance(value, str) and value.startswith(("s3://", "s3a://")):
        bucket = value.split("://", 1)[1].split("/", 1)[0]
        if not bucket:
            errors.append(f'{path}: expected "s3://bucket/prefix", got {_show(value)}')
            return None
        return value
    return _path(value, path, errors)


def _start(value: Any, path: str, errors: list[str]) -> Any:
    if value in ("head", "earliest"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    errors.append(
        f'{path}: expected "head", "earliest" or an LSN (an integer >= 1), got {_show(value)}'
    )
    return None


PARTITION_LAYOUTS = (("collection",), ("collection", "date"), ("collection", "date", "hour"))
_RETENTION_UNITS = {"d": 86_400, "h": 3_600}


def _partition_by(value: Any, path: str, errors: list[str]) -> Any:
    if isinstance(value, list) and tuple(value) in PARTITION_LAYOUTS:
        return tuple(value)
    shown = " | ".join("[" + ", ".join(f'"{c}"' for c in lay) + "]" for lay in PARTITION_LAYOUTS)
    errors.append(f"{path}: expected one of {shown}, got {_show(value)}")
    return None


def parse_retention(value: Any) -> int | None:
    """``"30d"`` or ``"12h"`` -> seconds; None when not such a string."""
    if isinstance(value, str) and len(value) >= 2 and value[-1] in _RETENTION_UNITS:
        n = value[:-1]
        if n.isdigit() and int(n) >= 1:
            return int(n) * _RETENTION_UNITS[value[-1]]
    return None


def _retention(value: Any, path: str, errors: list[str]) -> Any:
    seconds = parse_retention(value)
    if seconds is None:
        errors.append(
            f'{path}: expected a duration like "30d" or "12h" (days or hours, >= 1), '
            f"got {_show(value)}"
        )
    return seconds


def _function_ref(value: Any, path: str, errors: list[str]) -> Any:
    if isinstance(value, str):
        mod, sep, func = value.partition(":")
        if sep and func.isidentifier() and all(p.isidentifier() for p in mod.split(".")):
            return value
    errors.append(f'{path}: expected "package.module:function", got {_show(value)}')
    return None


def _section(raw: Any, path: str, spec: Mapping[str, Checker], errors: list[str]) -> dict[str, Any]:
    """Check one table against ``spec``; returns only the keys present and valid."""
    if not isinstance(raw, dict):
        errors.append(f"{path}: expected a table, got {_show(raw)}")
        return {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else key
        checker = spec.get(key)
        if checker is None:
            known = ", ".join(sorted(spec))
            errors.append(f"{where}: unknown key (known keys: {known})")
            continue
        converted = checker(value, where, errors)
        if converted is not None:
            out[key] = converted
    return out


_HEX = frozenset("0123456789abcdef")


def _sha256(value: Any, path: str, errors: list[str]) -> Any:
    """64 hex digits. The value is never shown: a token pasted here by mistake
    must not reach a terminal or a log."""
    if isinstance(value, str) and len(value) == 64 and set(value.lower()) <= _HEX:
        return value.lower()
    what = f"a string of {len(value)} characters" if isinstance(value, str) else _show(value)
    errors.append(
        f"{path}: expected the token's SHA-256 as 64 hex digits "
        f'(printf %s "$TOKEN" | sha256sum), got {what}'
    )
    return None


def _names(value: Any, path: str, errors: list[str]) -> Any:
    if isinstance(value, list) and all(isinstance(c, str) and c for c in value):
        return tuple(value)
    errors.append(f"{path}: expected an array of non-empty strings, got {_show(value)}")
    return None


_TOKEN: dict[str, Checker] = {
    "name": _str(),
    "sha256": _sha256,
    "cert_subject": _str(),
    "collections": lambda v, p, e: _collections(v, p, e),
    "collection_prefixes": _names,
    "max_events_per_s": _int(1),
    "max_bytes_per_s": _int(1),
}


def parse_tokens(raw: Any, path: str, errors: list[str]) -> tuple[ProducerToken, ...]:
    """``[[ingest.tokens]]`` entries (inline, or a tokens file's); every problem
    goes to ``errors`` with ``path`` (``ingest.tokens``, or the file's) as its prefix."""
    out: list[ProducerToken] = []
    for i, table in enumerate(_array_of_tables(raw, path, errors)):
        where = f"{path}[{i}]"
        before = len(errors)
        got = _section(table, where, _TOKEN, errors)
        _required(table, ("name",), where, errors)
        if ("sha256" in table) == ("cert_subject" in table):
            errors.append(
                f"{where}: needs exactly one of sha256 (a bearer token's hash) or "
                "cert_subject (a TLS client certificate's subject)"
            )
        if "collections" not in table and "collection_prefixes" not in table:
            errors.append(
                f'{where}.collections: required key is missing ("*", or the collections '
                "this producer may write; or collection_prefixes)"
            )
        if len(errors) == before:
            out.append(ProducerToken(**got))
    return tuple(out)


def check_token_set(tokens: tuple[ProducerToken, ...], path: str, errors: list[str]) -> None:
    """Names, hashes and subjects are unique across the inline entries and the tokens
    file (messages name the producers: entries that failed their own checks are gone)."""
    names: set[str] = set()
    owners: dict[tuple[str, str], str] = {}
    for t in tokens:
        if t.name in names:
            errors.append(f'{path}: producer name "{t.name}" appears twice')
        names.add(t.name)
        for key, value in (("sha256", t.sha256), ("cert_subject", t.cert_subject)):
            if value is None:
                continue
            other = owners.setdefault((key, value), t.name)
            if other != t.name:
                errors.append(f'{path}: producers "{other}" and "{t.name}" have the same {key}')


_TLS_KEYS = ("tls_cert", "tls_key", "tls_client_ca")


def _with_tls(got: dict[str, Any], section: str, errors: list[str]) -> dict[str, Any]:
    """``tls_cert``, ``tls_key``, ``tls_client_ca`` of a listener -> its ``tls``."""
    files = {k: got.pop(k) for k in _TLS_KEYS if k in got}
    if not files:
        return got
    if ("tls_cert" in files) != ("tls_key" in files):
        have, missing = ("tls_cert", "tls_key") if "tls_cert" in files else ("tls_key", "tls_cert")
        errors.append(f"{section}.{missing}: required with {section}.{have} (PEM files)")
    elif "tls_client_ca" in files and "tls_cert" not in files:
        errors.append(
            f"{section}.tls_client_ca: needs {section}.tls_cert and {section}.tls_key "
            "(client certificates are checked in a TLS handshake)"
        )
    got["tls"] = TlsConfig(files.get("tls_cert"), files.get("tls_key"), files.get("tls_client_ca"))
    return got


_TLS: dict[str, Checker] = {k: _path for k in _TLS_KEYS}

# A daemon's name: a partition value (``writer=<name>``) and a part of file
# and property names of a shared table, so plain characters only.
_DAEMON_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def _daemon_name(value: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(value, str) or not _DAEMON_NAME.match(value):
        errors.append(
            f"{path}: expected 1-63 letters, digits, '_', '.' or '-' (starting with a letter "
            f"or digit), got {_show(value)}: the name is a folder and a property name in a "
            f"shared table"
        )
        return None
    return value


_DAEMON: dict[str, Checker] = {
    "data_dir": _path,
    "name": _daemon_name,
    "cores": _int(1, 256),
    "shutdown_timeout_s": _float(0.0),
}
_INGEST: dict[str, Checker] = {
    "listen": _listen,
    "max_body_bytes": _int(1 * KiB),
    "max_event_bytes": _int(
        64,
        MAX_EVENT_BYTES,
        why="the CDC writers refuse a JSON string longer than 20,000,000 characters",
    ),
    "max_events_per_request": _int(1),
    "max_json_depth": _int(
        1,
        MAX_JSON_DEPTH,
        why="deeper JSON nears the JSON decoder's recursion limit, about 1000 levels",
    ),
    "max_event_id_chars": _int(1, 65_536),
    "header_timeout_s": _float(0.0),
    "body_timeout_s": _float(0.0),
    "max_connections": _int(1),
    "max_buffered_bytes": _int(1 * KiB),
    "max_lag_events": _int(1),
    "retry_after_s": _int(1),
    "idempotency_window_s": _float(0.0, exclusive=False),
    "idempotency_max_keys": _int(1),
    # The WAL keeps keys up to 65,535 bytes; a producer's key takes 9 more (its scope).
    "max_idempotency_key_bytes": _int(1, 65_526),
    "drain_grace_s": _float(0.0, exclusive=False),
    **_TLS,
    "tokens_file": _path,
    "tokens": lambda v, p, e: parse_tokens(v, p, e),
}
_ADMIN: dict[str, Checker] = {
    "listen": _listen,
    **_TLS,
    "token_sha256": _sha256,
    "open_probes": _bool,
}
# [wal.archive] (docs/wal.md, "The archive").
_WAL_ARCHIVE: dict[str, Checker] = {
    "uri": lambda v, p, e: _archive_uri(v, p, e),
    "ack": _choice("local", "archived"),
    "flush_ms": _int(1, 60_000),
    "max_unarchived_bytes": _int(1 * MiB, unit="bytes"),
    "role": _choice("primary", "standby"),
    "poll_ms": _int(50, 60_000),
}


def _archive_uri(value: Any, path: str, errors: list[str]) -> Any:
    uri = value if isinstance(value, str) else ""
    if uri.startswith(("s3://", "s3a://")) and uri.split("://", 1)[1].split("/", 1)[0]:
        return value
    errors.append(f'{path}: expected "s3://bucket/prefix", got {_show(value)}')
    return None


def _wal_archive(value: Any, path: str, errors: list[str]) -> Any:
    got = _section(value, path, _WAL_ARCHIVE, errors)
    if isinstance(value, dict) and "uri" not in value:
        errors.append(f"{path}.uri: required key is missing")
        return None
    return WalArchiveConfig(**got) if "uri" in got else None


_WAL: dict[str, Checker] = {
    "archive": _wal_archive,
    "segment_bytes": _int(1 * MiB, 1 * GiB, unit="bytes"),
    "fsync": _choice("always", "interval", "never"),
    "fsync_interval_ms": _int(1),
    "retention": _choice("watermarks", "keep"),
    "max_group_bytes": _int(64 * KiB),
}
_CONSUMER: dict[str, Checker] = {
    "ring_capacity": _int(2),
    "ring_max_bytes": _int(1 * KiB),
    "poll_min_ms": _float(0.0),
    "poll_max_ms": _float(0.0),
    "idle_polls_before_backoff": _int(1),
    "drain_max": _int(1),
    "pending_max_bytes": _int(1 * KiB),
    "replay_retries": _int(0),
    "replay_retry_ms": _int(1),
    "watermark_flush_ms": _int(10),
}
_SPARK: dict[str, Checker] = {
    "master": _str(),
    "remote": _str(nonempty=False),
    "app_name": _str(),
    "ui": _bool,
    "log_level": _choice("TRACE", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF"),
    "conf": lambda v, p, e: _string_table(v, p, e),
    "warmup_rows": _int(0, 1_000_000),
    "class_sharing": _bool,
    "direct_write": _bool,
}
_MICROBATCH: dict[str, Checker] = {
    "interval_ms": _int(10),
    "max_rows": _int(1),
    "catchup_max_rows": _int(1),
    "retry_initial_ms": _int(1),
    "retry_max_ms": _int(1),
    "build_max_bytes": _int(64 * KiB),
}
_DLQ: dict[str, Checker] = {"max_entries": _int(1)}
_S3: dict[str, Checker] = {
    "endpoint": _str(nonempty=False),
    "region": _str(),
    "path_style": _bool,
    "credentials_file": _path,
    "profile": _str(),
    "access_key_id": _str(),
    "secret_access_key": _str(),
    "connect_timeout_s": _float(0.0),
    "request_timeout_s": _float(0.0),
    "max_retries": _int(0, 20),
    "lease_ttl_s": _float(0.0),
    "lease_skew_s": _float(0.0, exclusive=False),
}
_HEALTH: dict[str, Checker] = {
    "stall_after_s": _float(0.0),
    "attempt_slow_s": _float(0.1),
    "session_restart_attempts": _int(1),
    "paused_max_lag_events": _int(0),
}
_LOG: dict[str, Checker] = {
    "level": _choice("debug", "info", "warning", "error"),
    "format": _choice("auto", "json", "console"),
}
_RETRY: dict[str, Checker] = {
    "max_attempts": _int(1),
    "initial_backoff_ms": _int(1),
    "max_backoff_ms": _int(1),
}
ACTION_TYPES = ("webhook", "python", "emit", "sql")
# Required keys per action type; the triggers package checks the rest.
_ACTION_REQUIRED: dict[str, tuple[str, ...]] = {
    "webhook": ("url",),
    "python": ("function",),
    "emit": ("collection",),
    "sql": ("statement",),
}


def _string_table(value: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(value, dict):
        errors.append(f"{path}: expected a table of strings, got {_show(value)}")
        return None
    out: dict[str, str] = {}
    for k, v in value.items():
        if isinstance(v, bool):
            out[k] = "true" if v else "false"
        elif isinstance(v, str | int | float):
            out[k] = str(v)
        else:
            errors.append(f"{path}.{k}: expected a string or number, got {_show(v)}")
    return out


def _array_of_tables(raw: Any, path: str, errors: list[str]) -> list[Any]:
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        errors.append(f"{path}: expected an array of tables ([[{path}]]), got {_show(raw)}")
        return []
    return raw


def _required(table: dict[str, Any], keys: tuple[str, ...], path: str, errors: list[str]) -> bool:
    missing = [k for k in keys if k not in table]
    for k in missing:
        errors.append(f"{path}.{k}: required key is missing")
    return not missing


_COMPACTION: dict[str, Checker] = {
    "compaction": _bool,
    "target_file_bytes": _int(1 * KiB, unit="bytes"),
    "compact_min_files": _int(2),
    "compact_interval_s": _float(0.0),
}
# One [[cdc.streams]] entry's keys (docs/configuration.md lists each: tests/test_config_docs.py).
_STREAM: dict[str, Checker] = {
    "name": _str(),
    "collections": lambda v, p, e: _collections(v, p, e),
    "path": _table_path,
    "start": _start,
    "partition_by": _partition_by,
    "retention": _retention,
    "retention_check_s": _float(0.0),
    "quarantine_max_rows": _int(0),
    "format": _choice("parquet", "delta"),
    "variant": _bool,
    # Delta's VACUUM counts whole hours (it rounds 0.4 to a window of 0,
    # which removes the files of commits running beside it).
    "vacuum_retain_hours": _int(1, why="Delta's VACUUM window is whole hours"),
    "writers": _choice("single", "shared"),
    **_COMPACTION,
}
_STREAM_KEYS = ("quarantine_max_rows", "format", "variant", "vacuum_retain_hours", "writers")

# A mirror's own columns, before its typed ones (docs/cdc.md, "Mirror tables").
MIRROR_COLUMNS = ("key", "bucket", "lsn", "op", "updated_at", "producer", "doc")
# A history mirror's columns after those (docs/cdc.md, "History").
HISTORY_COLUMNS = ("valid_from_lsn", "valid_to_lsn", "valid_from", "valid_to", "is_current")
_DECIMAL = re.compile(r"^decimal\((\d+),\s*(\d+)\)$")


def _mirror_type(value: Any) -> str | None:
    """A column type as the mirror keeps it ("decimal(10,2)"), None if unknown."""
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    if text in MIRROR_TYPES:
        return text
    m = _DECIMAL.match(text)
    if m and 1 <= int(m.group(1)) <= 38 and 0 <= int(m.group(2)) <= int(m.group(1)):
        return f"decimal({int(m.group(1))},{int(m.group(2))})"
    return None


def _mirror_columns(value: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(value, dict):
        errors.append(f'{path}: expected a table like {{ amount = "double" }}, got {_show(value)}')
        return None
    out: list[tuple[str, str]] = []
    for name, kind in value.items():
        typed = _mirror_type(kind)
        if name in MIRROR_COLUMNS + HISTORY_COLUMNS:
            own = ", ".join(MIRROR_COLUMNS + HISTORY_COLUMNS)
            errors.append(f"{path}.{name}: a mirror's own column ({own})")
        elif not name.isidentifier():
            errors.append(f"{path}.{name}: expected a column name of letters, digits and _")
        elif typed is None:
            shown = " | ".join(f'"{t}"' for t in MIRROR_TYPES)
            errors.append(f'{path}.{name}: expected {shown} | "decimal(p,s)", got {_show(kind)}')
        else:
            out.append((name, typed))
    return tuple(out)


# Longest cdc.mirrors[].merge_interval_ms (an hour).
MIRROR_MERGE_INTERVAL_MAX_MS = 3_600_000
# One [[cdc.mirrors]] entry's keys.
_MIRROR: dict[str, Checker] = {
    "name": _str(),
    "collection": _str(),
    "path": _table_path,
    "columns": _mirror_columns,
    "strict": _bool,
    "buckets": _int(1, 10_000),
    "history": _bool,
    "merge_interval_ms": _int(
        0, MIRROR_MERGE_INTERVAL_MAX_MS, why="an hour: the WAL and memory hold what waits"
    ),
    "merge_max_events": _int(1, 100_000_000, why="the held batches' rows stay in memory"),
}


def _parse_mirrors(raw: Any, errors: list[str]) -> list[CdcMirror]:
    out: list[CdcMirror] = []
    seen: dict[str, int] = {}
    for i, table in enumerate(_array_of_tables(raw, "cdc.mirrors", errors)):
        where = f"cdc.mirrors[{i}]"
        if isinstance(table, dict) and "writers" in table:
            errors.append(
                f"{where}.writers: a mirror has one writer, so it takes no writers key: its "
                f"merge keeps per key the event of the highest LSN, and the LSNs of two "
                f"daemons' WALs do not order one key's events (a CDC stream can be shared: "
                f'[[cdc.streams]] writers = "shared")'
            )
            continue
        got = _section(table, where, _MIRROR, errors)
        if not _required(table, ("name", "collection", "path"), where, errors):
            continue
        if len(got) != len(table):
            continue
        if got["name"] in seen:
            errors.append(
                f'{where}.name: duplicate mirror name "{got["name"]}" '
                f"(also cdc.mirrors[{seen[got['name']]}])"
            )
            continue
        seen[got["name"]] = i
        uri = got["path"] if isinstance(got["path"], str) else ""
        out.append(
            CdcMirror(
                got["name"],
                got["collection"],
                Path("mirrors") / got["name"] if uri else got["path"],
                got.get("columns", ()),
                got.get("strict", False),
                got.get("buckets", 16),
                uri=uri,
                history=got.get("history", False),
                merge_interval_ms=got.get("merge_interval_ms", 0),
                merge_max_events=got.get("merge_max_events", 1_000_000),
            )
        )
    return out


_HANDLER: dict[str, Checker] = {"function": _function_ref}
# The keys of [[triggers]]; each action type's own keys: triggers.spec._ACTION_KEYS.
_TRIGGER: dict[str, Checker] = {
    "name": _str(),
    "collection": _str(),
    "on": lambda v, p, e: _ops(v, p, e),
    "when": _str(),
    "action": lambda v, p, e: _action(v, p, e),
    "batch_size": _int(1),
    "retry": lambda v, p, e: RetryPolicy(**_section(v, p, _RETRY, e)),
    "enabled": _bool,
    "fire_on_derived": _bool,
}
# The plain sections: their keys and their dataclass; [cdc] and [[triggers]] are
# parsed by _parse_cdc and parse_triggers.
SECTIONS: dict[str, tuple[dict[str, Checker], type]] = {
    "daemon": (_DAEMON, DaemonConfig),
    "ingest": (_INGEST, IngestConfig),
    "admin": (_ADMIN, AdminConfig),
    "wal": (_WAL, WalConfig),
    "consumer": (_CONSUMER, ConsumerConfig),
    "spark": (_SPARK, SparkConfig),
    "microbatch": (_MICROBATCH, MicrobatchConfig),
    "dlq": (_DLQ, DlqConfig),
    "health": (_HEALTH, HealthConfig),
    "log": (_LOG, LogConfig),
    "s3": (_S3, S3Config),
}


def _parse_cdc(raw: Any, errors: list[str]) -> CdcConfig:
    body = raw if isinstance(raw, dict) else {}
    if not isinstance(raw, dict):
        errors.append(f"cdc: expected a table, got {_show(raw)}")
    for key in body:
        if key not in ("streams", "handlers", "mirrors"):
            errors.append(f"cdc.{key}: unknown key (known keys: handlers, mirrors, streams)")
    streams: list[CdcStream] = []
    seen: dict[str, int] = {}
    for i, table in enumerate(_array_of_tables(body.get("streams", []), "cdc.streams", errors)):
        where = f"cdc.streams[{i}]"
        got = _section(table, where, _STREAM, errors)
        if not _required(table, ("name", "collections", "path"), where, errors):
            continue
        if len(got) != len(table):
            continue
        partition_by = got.get("partition_by", ("collection",))
        if "retention" in got and "date" not in partition_by:
            errors.append(
                f"{where}.retention: needs a time partition: set partition_by = "
                f'["collection", "date"] (or ["collection", "date", "hour"]). Retention '
                f"removes whole date/hour folders; removing rows from inside files would "
                f"not be atomic for readers"
            )
            continue
        uri = got["path"] if isinstance(got["path"], str) else ""
        if uri and (got.get("format", "delta") != "delta" or got.get("variant")):
            why = "variant = true" if got.get("variant") else 'format = "parquet"'
            errors.append(
                f"{where}.path: a table on S3 ({uri}) must be a Delta table without "
                f'VARIANT columns (set format = "delta"; not {why}): a Parquet folder '
                f"has no atomic commit on object storage, and VARIANT needs Spark's writer"
            )
            continue
        if got.get("writers") == "shared" and (
            got.get("format", "delta") != "delta" or got.get("variant")
        ):
            why = "variant = true" if got.get("variant") else 'format = "parquet"'
            errors.append(
                f'{where}.writers: a shared table (writers = "shared") is a Delta table '
                f"without VARIANT columns (not {why}): several daemons' appends land through "
                f"Delta's log, which orders concurrent commits, and delta-rs commits them; a "
                f"Parquet folder's ledger has one writer"
            )
            continue
        delta_only = [k for k in ("variant", "vacuum_retain_hours") if k in got]
        if delta_only and got.get("format", "delta") != "delta":
            errors.append(
                f"{where}.{delta_only[0]}: applies to Delta tables only; set "
                f'format = "delta" or remove it (a Parquet table always has VARIANT columns)'
            )
            continue
        if got["name"] in seen:
            errors.append(
                f'{where}.name: duplicate stream name "{got["name"]}" '
                f"(also cdc.streams[{seen[got['name']]}])"
            )
            continue
        seen[got["name"]] = i
        streams.append(
            CdcStream(
                got["name"],
                got["collections"],
                Path("tables") / got["name"] if uri else got["path"],
                got.get("start", "head"),
                partition_by,
                got.get("retention"),
                got.get("retention_check_s", 300.0),
                **{k: got[k] for k in _COMPACTION if k in got},
                **{k: got[k] for k in _STREAM_KEYS if k in got},
                uri=uri,
            )
        )
    handlers: list[CdcHandler] = []
    for i, table in enumerate(_array_of_tables(body.get("handlers", []), "cdc.handlers", errors)):
        where = f"cdc.handlers[{i}]"
        got = _section(table, where, _HANDLER, errors)
        if _required(table, ("function",), where, errors) and "function" in got:
            handlers.append(CdcHandler(got["function"]))
    mirrors = _parse_mirrors(body.get("mirrors", []), errors)
    return CdcConfig(tuple(streams), tuple(handlers), tuple(mirrors))


def _collections(value: Any, path: str, errors: list[str]) -> Any:
    if value == "*":
        return ("*",)
    if isinstance(value, str) and value:
        return (value,)
    if isinstance(value, list) and value and all(isinstance(c, str) and c for c in value):
        return ("*",) if "*" in value else tuple(value)
    errors.append(f'{path}: expected "*" or a non-empty array of names, got {_show(value)}')
    return None


def _ops(value: Any, path: str, errors: list[str]) -> Any:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and value and all(v in OPS for v in value):
        return tuple(dict.fromkeys(value))
    errors.append(
        f'{path}: expected a non-empty array of "insert" | "update" | "delete", got {_show(value)}'
    )
    return None


def _action(value: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(value, dict):
        errors.append(
            f'{path}: expected a table like {{ type = "webhook", url = ... }}, got {_show(value)}'
        )
        return None
    kind = value.get("type")
    if kind not in ACTION_TYPES:
        shown = " | ".join(ACTION_TYPES)
        if kind is None:
            errors.append(f"{path}.type: required key is missing (one of {shown})")
        else:
            errors.append(f"{path}.type: unknown action type {_show(kind)} (expected {shown})")
        return None
    if not _required(value, _ACTION_REQUIRED[kind], path, errors):
        return None
    if kind == "python" and _function_ref(value["function"], f"{path}.function", errors) is None:
        return None
    return dict(value)


def parse_triggers(raw: Any, errors: list[str]) -> tuple[TriggerSpec, ...]:
    """Structural checks of ``[[triggers]]``; Spark analyses ``when`` at startup."""
    specs: list[TriggerSpec] = []
    seen: dict[str, int] = {}
    for i, table in enumerate(_array_of_tables(raw, "triggers", errors)):
        where = f"triggers[{i}]"
        before = len(errors)
        got = _section(table, where, _TRIGGER, errors)
        _required(table, ("name", "collection", "action"), where, errors)
        if len(errors) != before:
            continue
        name = got["name"]
        if name in seen:
            errors.append(
                f'{where}.name: duplicate trigger name "{name}" (also triggers[{seen[name]}])'
            )
            continue
        seen[name] = i
        got.setdefault("on", OPS)
        got.setdefault("when", "true")
        specs.append(TriggerSpec(**got))
    return tuple(specs)


def parse(raw: Mapping[str, Any], source: Path | None = None) -> Config:
    """Validate a parsed TOML document whole; raise ConfigError with every problem."""
    errors: list[str] = []
    sections = SECTIONS
    built: dict[str, Any] = {}
    for key, value in raw.items():
        if key in sections:
            checks, cls = sections[key]
            got = _section(value, key, checks, errors)
            if key in ("ingest", "admin"):
                got = _with_tls(got, key, errors)
            built[key] = cls(**got)
        elif key == "cdc":
            built["cdc"] = _parse_cdc(value, errors)
        elif key == "triggers":
            built["triggers"] = parse_triggers(value, errors)
        else:
            known = ", ".join(sorted([*sections, "cdc", "triggers"]))
            errors.append(f"{key}: unknown section (known sections: {known})")

    cfg = Config(**built, source=source)
    _cross_checks(cfg, errors)
    if errors:
        raise ConfigError(errors, str(source) if source else "config")
    return _resolve_paths(cfg)


def _cross_checks(cfg: Config, errors: list[str]) -> None:
    c = cfg.consumer
    if c.poll_max_ms < c.poll_min_ms:
        errors.append(
            f"consumer.poll_max_ms: must be >= consumer.poll_min_ms ({c.poll_min_ms:g}), "
            f"got {c.poll_max_ms:g}"
        )
    m = cfg.microbatch
    if m.retry_max_ms < m.retry_initial_ms:
        errors.append("microbatch.retry_max_ms: must be >= microbatch.retry_initial_ms")
    if m.catchup_max_rows < m.max_rows:
        errors.append(
            f"microbatch.catchup_max_rows: must be >= microbatch.max_rows ({m.max_rows}), "
            f"got {m.catchup_max_rows}"
        )
    if cfg.ingest.max_event_bytes > cfg.ingest.max_body_bytes:
        errors.append("ingest.max_event_bytes: must be <= ingest.max_body_bytes")
    if cfg.ingest.max_buffered_bytes < cfg.ingest.max_body_bytes:
        errors.append(
            f"ingest.max_buffered_bytes: must be >= ingest.max_body_bytes "
            f"({cfg.ingest.max_body_bytes}), or a body of the maximum size could never be read"
        )
    if cfg.ingest.listen == cfg.admin.listen and cfg.ingest.listen.port != 0:
        errors.append(f"admin.listen: same address as ingest.listen ({cfg.ingest.listen})")
    if cfg.spark.remote and "master" in cfg.spark.conf:
        errors.append("spark.conf.master: use spark.master or spark.remote, not conf")
    duplicates = cfg.spark.conf.get(ALLOW_DUPLICATE_KEYS)
    if duplicates is not None and duplicates.strip().lower() != "true":
        errors.append(
            f"spark.conf.{ALLOW_DUPLICATE_KEYS}: must stay true (the daemon's default), got "
            f"{_show(duplicates)}: ingest accepts a JSON object that repeats a key (the last "
            "one wins), and with false the CDC writers refuse it, so one such event would "
            "fail every batch of its stream"
        )
    check_token_set(cfg.ingest.tokens, "ingest.tokens", errors)
    if cfg.ingest.tls.client_ca is None:
        for token in cfg.ingest.tokens:
            if token.cert_subject is not None:
                errors.append(
                    f'ingest.tokens: producer "{token.name}": cert_subject needs '
                    "ingest.tls_client_ca (a client certificate is only asked for, and "
                    "checked, with it)"
                )
    for t in cfg.triggers:
        if t.retry.max_backoff_ms < t.retry.initial_backoff_ms:
            errors.append(f"triggers.{t.name}.retry.max_backoff_ms: must be >= initial_backoff_ms")
    s3 = cfg.s3
    if s3.lease_ttl_s <= 2 * s3.lease_skew_s:
        errors.append(
            f"s3.lease_ttl_s: must exceed twice s3.lease_skew_s ({s3.lease_skew_s:g}), got "
            f"{s3.lease_ttl_s:g}: a writer stops committing skew_s before its lease expires"
        )
    # The rule: no S3 request of a commit can outlive the lease window.
    window = s3.lease_ttl_s - s3.lease_skew_s
    if s3.lease_ttl_s > 2 * s3.lease_skew_s and s3.request_worst_s >= window:
        errors.append(
            f"s3.request_timeout_s: one S3 request with its retries, (connect_timeout_s "
            f"{s3.connect_timeout_s:g} + request_timeout_s {s3.request_timeout_s:g}) x "
            f"(max_retries {s3.max_retries} + 1) = {s3.request_worst_s:g} s, must be shorter "
            f"than the lease window, lease_ttl_s - lease_skew_s = {window:g} s: no S3 request "
            f"of a commit can outlive the lease window. Lower request_timeout_s, "
            f"connect_timeout_s or max_retries, or raise lease_ttl_s"
        )
    shared = [(i, st) for i, st in enumerate(cfg.cdc.streams) if st.writers == "shared"]
    if shared and not cfg.daemon.name:
        i, st = shared[0]
        errors.append(
            f'daemon.name: required, since cdc.streams[{i}] ("{st.name}") has writers = '
            f'"shared": each daemon appending to a shared table names itself there (its rows\' '
            f"writer column, its own files and checks), so set a name unique among the "
            f"table's writers and keep it across restarts"
        )
    archive = cfg.wal.archive
    if archive is not None and archive.role == "standby":
        _standby_checks(cfg, errors)
    if bool(s3.access_key_id) != bool(s3.secret_access_key):
        errors.append("s3.access_key_id: set both access_key_id and secret_access_key, or neither")
    if s3.access_key_id and s3.credentials_file is not None:
        errors.append("s3.credentials_file: set credentials_file or access_key_id, not both")


def _standby_checks(cfg: Config, errors: list[str]) -> None:
    """A standby's tables are on S3: at a takeover it goes on writing the
    primary's tables, and a folder on its own disk holds none of them."""
    why = (
        'a standby ([wal.archive] role = "standby") may name only tables on S3 '
        '(path = "s3://bucket/prefix"): the primary writes a local folder on its own '
        "disk, so the same folder on this machine holds no table the primary wrote, "
        "and a takeover would continue a table that is not there"
    )
    for i, s in enumerate(cfg.cdc.streams):
        if not s.uri:
            errors.append(
                f'cdc.streams[{i}].path: stream "{s.name}" is the local folder {s.path}; {why}'
            )
    for i, m in enumerate(cfg.cdc.mirrors):
        if not m.uri:
            errors.append(
                f'cdc.mirrors[{i}].path: mirror "{m.name}" is the local folder {m.path}; {why}'
            )


def _resolve_paths(cfg: Config) -> Config:
    """Relative paths are relative to the config file's folder, like nginx and systemd."""
    base = cfg.source.parent if cfg.source else Path.cwd()

    def resolve(p: Path) -> Path:
        return p if p.is_absolute() else (base / p)

    daemon = dataclasses.replace(cfg.daemon, data_dir=resolve(cfg.daemon.data_dir))
    data_dir = resolve(cfg.daemon.data_dir)

    def secret(p: Path | None) -> Path | None:
        return None if p is None else resolve(credential_path(p))

    def tls(t: TlsConfig) -> TlsConfig:
        return TlsConfig(secret(t.cert), secret(t.key), secret(t.client_ca))

    s3 = dataclasses.replace(cfg.s3, credentials_file=secret(cfg.s3.credentials_file))
    streams = tuple(
        dataclasses.replace(s, path=data_dir / s.path, s3=s3)
        if s.uri
        else dataclasses.replace(s, path=resolve(s.path))
        for s in cfg.cdc.streams
    )
    mirrors = tuple(
        dataclasses.replace(m, path=data_dir / m.path, s3=s3)
        if m.uri
        else dataclasses.replace(m, path=resolve(m.path))
        for m in cfg.cdc.mirrors
    )
    ingest = dataclasses.replace(
        cfg.ingest, tls=tls(cfg.ingest.tls), tokens_file=secret(cfg.ingest.tokens_file)
    )
    admin = dataclasses.replace(cfg.admin, tls=tls(cfg.admin.tls))
    fields = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
    fields.update(
        daemon=daemon,
        s3=s3,
        cdc=CdcConfig(streams, cfg.cdc.handlers, mirrors),
        ingest=ingest,
        admin=admin,
    )
    return Config(**fields)


# systemd's LoadCredential= puts a unit's secrets in this folder and names it here.
ENV_CREDENTIALS = "CREDENTIALS_DIRECTORY"
_CREDENTIAL_PREFIXES = (f"${{{ENV_CREDENTIALS}}}/", f"${ENV_CREDENTIALS}/")


def credential_path(p: Path) -> Path:
    """A secret's path that starts with ``${CREDENTIALS_DIRECTORY}/``: in the folder
    that variable names (set by systemd for a unit with ``LoadCredential=``, or by
    hand for ``check-config``); unset, the path stays as written, and the file
    check says so (docs/security.md, "systemd")."""
    text = str(p)
    for prefix in _CREDENTIAL_PREFIXES:
        folder = os.environ.get(ENV_CREDENTIALS)
        if text.startswith(prefix) and folder:
            return Path(folder) / text[len(prefix) :]
    return p


ENV_CONFIG = "EVENTPLANE_CONFIG"


def default_path() -> Path:
    return Path(os.environ.get(ENV_CONFIG, "config.toml"))


def load(path: Path | str | None = None) -> Config:
    """Read and validate a config file; raise ConfigError with every problem."""
    source = Path(path) if path is not None else default_path()
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{source}: file not found"], str(source)) from None
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read ({exc.strerror})"], str(source)) from exc
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML ({exc})"], str(source)) from exc
    return parse(raw, source.resolve())
