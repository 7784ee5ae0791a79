"""The configuration's types: one frozen dataclass per section of ``config.toml``.

:mod:`daemon.config` builds them (its steps: read the TOML, check every key
of every section and collect each problem with its key path, cross-check the
sections, resolve paths), and re-exports every name here, so code imports
them from ``daemon.config``. Defaults live on the fields; the constants
above them are the ceilings the checks use.

Each key, its default and why: docs/configuration.md, "Every key".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

FsyncMode = Literal["always", "interval", "never"]
RetentionMode = Literal["watermarks", "keep"]
LogFormat = Literal["auto", "json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
Op = Literal["insert", "update", "delete"]
OPS: tuple[Op, ...] = ("insert", "update", "delete")

# ingest.max_json_depth's ceiling: msgspec recurses once per level and raises
# RecursionError near 1000 levels (Python's recursion limit, less its caller's
# frames); well below that, every payload too deep is one msgspec can decode and
# ingest can answer with its position (daemon/ingest/payload.py).
MAX_JSON_DEPTH = 512
# ingest.max_event_bytes's ceiling: the CDC writers' JSON parser (Jackson) refuses a
# string of more than 20,000,000 characters; an event of at most this many bytes
# cannot hold one (daemon/ingest/payload.py, MAX_STRING_CHARS).
MAX_EVENT_BYTES = 20_000_000
# Spark's parse_json setting that the daemon sets to true (daemon/spark/session.py) and a
# user's [spark.conf] may not turn off (_cross_checks).
ALLOW_DUPLICATE_KEYS = "spark.sql.variant.allowDuplicateKeys"


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    data_dir: Path = Path("var")
    cores: int = 4
    # Must stay below the unit's TimeoutStopSec (30 s in systemd/eventplane.service).
    shutdown_timeout_s: float = 20.0
    # The daemon's name among the writers of a shared table ("": none).
    name: str = ""


@dataclass(frozen=True, slots=True)
class ProducerToken:
    """One ``[[ingest.tokens]]`` entry: who a producer is, and what it may write.

    It names the producer by the SHA-256 of its bearer token (``sha256``, 64 hex
    digits: the token itself never appears in a config) or by the subject of
    its TLS client certificate (``cert_subject``, as ``openssl x509 -noout
    -subject -nameopt RFC2253`` prints it). docs/security.md is the user's page.
    """

    name: str
    collections: tuple[str, ...] = ()  # ("*",): every collection
    collection_prefixes: tuple[str, ...] = ()
    sha256: str | None = field(default=None, repr=False)  # lower-case hex; never shown
    cert_subject: str | None = None
    # Quota (a token bucket holding one second's worth); None: no limit.
    max_events_per_s: int | None = None
    max_bytes_per_s: int | None = None

    def allows(self, collection: str) -> bool:
        if self.collections == ("*",) or collection in self.collections:
            return True
        return any(collection.startswith(p) for p in self.collection_prefixes)

    @property
    def unrestricted(self) -> bool:
        return self.collections == ("*",)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """A listener's TLS files; all None: plain HTTP."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None


@dataclass(frozen=True, slots=True)
class IngestConfig:
    listen: Listen = Listen("127.0.0.1", 8470)
    max_body_bytes: int = 16 * MiB
    max_event_bytes: int = 1 * MiB
    max_events_per_request: int = 10_000
    # Deepest nesting of a new/old payload accepted (its outermost object is level 1);
    # deeper gets 422. The CDC writers take 1000; at most MAX_JSON_DEPTH.
    max_json_depth: int = 128
    # Longest producer event id ("id") accepted, in characters; longer gets 422.
    max_event_id_chars: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 256
    # Bodies being read or parsed at once hold at most this many bytes; more
    # requests wait their turn (within their body deadline).
    max_buffered_bytes: int = 128 * MiB
    # Disk bound (invariant 12): 429 when the slowest core lags more than this.
    max_lag_events: int = 50_000_000
    retry_after_s: int = 1
    # Idempotent requests (docs/ingest.md): how long and how many request keys
    # are remembered; a retry within both bounds is answered from the original.
    idempotency_window_s: float = 900.0
    idempotency_max_keys: int = 100_000
    max_idempotency_key_bytes: int = 255
    # Drain (SIGTERM): while producer connections are open, the listener keeps
    # answering 503 draining this long before it closes (docs/ingest.md, "Draining").
    drain_grace_s: float = 1.0
    # TLS (tls_cert, tls_key, tls_client_ca) and producer tokens: docs/security.md.
    # ``tokens`` holds the inline [[ingest.tokens]]; the daemon reads tokens_file's
    # at start and on SIGHUP (daemon.security.load_tokens), not the config loader:
    # a client command run by an operator need not be able to read it.
    tls: TlsConfig = TlsConfig()
    tokens_file: Path | None = None
    tokens: tuple[ProducerToken, ...] = ()


@dataclass(frozen=True, slots=True)
class AdminConfig:
    listen: Listen = Listen("127.0.0.1", 9470)
    tls: TlsConfig = TlsConfig()
    # Hex SHA-256 of the admin bearer token; None: the admin API is open.
    token_sha256: str | None = field(default=None, repr=False)
    # /healthz, /readyz and /metrics answer without the token (probes, Prometheus).
    open_probes: bool = True


@dataclass(frozen=True, slots=True)
class WalArchiveConfig:
    """``[wal.archive]``: the WAL's copy off this machine (docs/wal.md, "The
    archive"); the store's endpoint and credentials are ``[s3]``'s."""

    uri: str = ""  # "s3://bucket/prefix"
    # "local": 2xx after the local fsync; "archived": after the archive holds the events too.
    ack: Literal["local", "archived"] = "local"
    flush_ms: int = 100  # the longest a group waits before its upload
    max_unarchived_bytes: int = 1 * GiB  # past this, ingest answers 503 + Retry-After
    # "primary": holds the archive's manifest and takes events; "standby": holds
    # nothing, answers ingest 503 "standby" (docs/operating.md, "A standby").
    role: Literal["primary", "standby"] = "primary"
    # A standby lists the archive this often and downloads what is new (daemon/follow.py).
    poll_ms: int = 1000


@dataclass(frozen=True, slots=True)
class WalConfig:
    segment_bytes: int = 64 * MiB
    fsync: FsyncMode = "always"
    fsync_interval_ms: int = 100
    retention: RetentionMode = "watermarks"
    # Upper bound on one group commit; bigger groups wait for the next fsync.
    max_group_bytes: int = 8 * MiB
    archive: WalArchiveConfig | None = None  # none: no archive, nothing changes


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    ring_capacity: int = 65_536
    ring_max_bytes: int = 64 * MiB
    poll_min_ms: float = 1.0
    poll_max_ms: float = 50.0
    idle_polls_before_backoff: int = 32
    drain_max: int = 1024
    # Memory shed: above this many bytes of undelivered slice data a core
    # stops taking from its ring and catches up from the WAL instead.
    pending_max_bytes: int = 256 * MiB
    replay_retries: int = 10
    replay_retry_ms: int = 100
    watermark_flush_ms: int = 5_000


@dataclass(frozen=True, slots=True)
class SparkConfig:
    master: str = "local[*]"
    remote: str = ""
    app_name: str = "eventplane"
    ui: bool = False
    log_level: str = "WARN"
    conf: Mapping[str, str] = field(default_factory=dict)
    # Synthetic events a new session writes into a scratch table before the
    # first real batch (daemon/spark/warmup.py); 0 turns the warm-up off.
    warmup_rows: int = 20_000
    # The driver JVM maps Spark's classes from an archive under data_dir
    # (class data sharing; daemon.spark.session.class_sharing). Off by
    # default: a 171 MB file, written by the first JVM as it exits (13-19 s
    # here), for a faster start only.
    class_sharing: bool = False
    # A batch in a raw inbox file is written by Spark's Parquet writer in the
    # driver, a thread per split, without a Spark job (daemon.table.parquet,
    # step 1); false: every batch runs a job.
    direct_write: bool = True


@dataclass(frozen=True, slots=True)
class MicrobatchConfig:
    interval_ms: int = 1_000
    max_rows: int = 100_000
    catchup_max_rows: int = 1_000_000
    retry_initial_ms: int = 500
    retry_max_ms: int = 30_000
    # Arrow bytes the Spark executor holds while it writes a batch's input
    # (one inbox row group); its working set is about 3x this.
    build_max_bytes: int = 16 * MiB


@dataclass(frozen=True, slots=True)
class S3Config:
    """How to reach the object store of the streams whose path is ``s3://``
    (docs/cdc.md, "Tables on S3"). Secrets stay out of ``repr``."""

    endpoint: str = ""  # "" : AWS's own endpoint of the region
    region: str = "us-east-1"
    # Path-style URLs (http://host/bucket/key), as MinIO and SeaweedFS want.
    path_style: bool = False
    # An AWS shared-credentials file (INI: [profile] aws_access_key_id = ...).
    credentials_file: Path | None = None
    profile: str = "default"
    access_key_id: str = field(default="", repr=False)
    secret_access_key: str = field(default="", repr=False)
    # Each S3 request's bounds (boto3 and delta-rs): small enough that one
    # request with its retries fits the lease window (config.py, _cross_checks).
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 5.0
    max_retries: int = 2
    # The writer's lease on each table (daemon/table/lease.py): it expires this
    # long after its last renewal; renewed every (ttl - skew) / 3 seconds.
    lease_ttl_s: float = 30.0
    lease_skew_s: float = 5.0

    @property
    def request_worst_s(self) -> float:
        """The longest one S3 request can take, its retries included."""
        return (self.connect_timeout_s + self.request_timeout_s) * (self.max_retries + 1)


@dataclass(frozen=True, slots=True)
class CdcStream:
    name: str
    collections: tuple[str, ...]  # ("*",) means every collection
    # The table's folder; for a table on S3, the folder of the stream's own
    # state (ledger, lock, quarantine): <data_dir>/tables/<name>.
    path: Path
    # Where a stream new to the data_dir starts: "head" (the live batches from
    # now on), "earliest" (the oldest retained event) or an LSN; the events
    # below the live batches are backfilled from the WAL (docs/cdc.md).
    start: str | int = "head"
    # Hive partition columns of the table, in folder order: "collection" first,
    # then optionally "date" (UTC day of ingest_ts) and "hour" (docs/cdc.md,
    # "Time partitioning and retention").
    partition_by: tuple[str, ...] = ("collection",)
    # Seconds after which a whole time partition is removed; None keeps forever.
    retention_s: int | None = None
    # How often the daemon looks for expired partitions of this stream.
    retention_check_s: float = 300.0
    # Compaction (docs/cdc.md, "Compaction"): merge a partition's small files
    # into files near target_file_bytes, in the background, once a size tier
    # of the partition holds compact_min_files files; checked every
    # compact_interval_s.
    compaction: bool = True
    target_file_bytes: int = 128 * MiB
    compact_min_files: int = 16
    compact_interval_s: float = 60.0
    # Most rows of one batch the stream sets aside in its quarantine (docs/cdc.md,
    # "Quarantine"). More rows failing alone means the writer, not the rows, is
    # broken: the batch then fails and is retried, and health says why.
    quarantine_max_rows: int = 1000
    # The table's format (docs/cdc.md, "Table formats"): "delta" (a Delta Lake
    # table: snapshot reads for every reader, time travel; written by the
    # direct write and delta-rs, Delta's jars only for a Spark append,
    # daemon/spark/deltajars.py) or "parquet" (folders of Parquet files with
    # the daemon's own ledger; plain readers can miss rows while compaction
    # swaps, invariant 16).
    format: str = "delta"
    # Delta only: add the VARIANT columns new and old next to the JSON text.
    # Spark reads them; delta-rs, Polars and DuckDB then cannot open the table.
    variant: bool = False
    # Delta only: VACUUM keeps the files a snapshot of the last this many
    # hours still reads (a reader that runs longer than that can fail).
    vacuum_retain_hours: int = 168
    # The table's URI when it is on S3 ("s3://bucket/prefix"; "": at path).
    uri: str = ""
    s3: S3Config | None = None
    # "shared": several daemons append to this Delta table, each as its
    # [daemon] name (docs/cdc.md, "Shared tables"); "single": this one only.
    writers: str = "single"

    @property
    def location(self) -> str:
        """Where the table is, as users name it: its URI or its folder."""
        return self.uri or str(self.path)

    def wants(self, collection: str) -> bool:
        return self.collections == ("*",) or collection in self.collections


# The types a mirror's typed column may have ("decimal(p,s)" besides).
MIRROR_TYPES = ("string", "long", "double", "boolean", "timestamp", "date")


@dataclass(frozen=True, slots=True)
class CdcMirror:
    """One ``[[cdc.mirrors]]`` entry: a collection's current state, one row per
    key, as a Delta table (docs/cdc.md, "Mirror tables")."""

    name: str  # its stage is "mirror:<name>"
    collection: str
    # The table's folder; for a table on S3, the folder of the mirror's own
    # state (its lock): <data_dir>/mirrors/<name>.
    path: Path
    # Typed columns from `new`, in order: (name, type), type one of
    # MIRROR_TYPES or "decimal(p,s)".
    columns: tuple[tuple[str, str], ...] = ()
    # Ingest refuses (422) an event whose `new` does not fit the columns.
    strict: bool = False
    # The table's partitions: bucket = crc32(key) % buckets, fixed at creation.
    buckets: int = 16
    uri: str = ""  # "s3://bucket/prefix" when on S3
    s3: S3Config | None = None
    # SCD type 2: a row per version of a key (valid_from_lsn .. valid_to_lsn),
    # not one per key; fixed when the table is made.
    history: bool = False
    # 0: one merge per batch; N: the batches of up to N ms merged in one
    # commit (docs/cdc.md, "Coalesced merges").
    merge_interval_ms: int = 0
    # The most events of the collection held for one coalesced merge: the
    # batch that reaches it merges the group at once.
    merge_max_events: int = 1_000_000

    @property
    def location(self) -> str:
        return self.uri or str(self.path)


@dataclass(frozen=True, slots=True)
class CdcHandler:
    function: str  # "pkg.mod:func", called as func(df, batch_id)


@dataclass(frozen=True, slots=True)
class CdcConfig:
    streams: tuple[CdcStream, ...] = ()
    handlers: tuple[CdcHandler, ...] = ()
    mirrors: tuple[CdcMirror, ...] = ()


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 5
    initial_backoff_ms: int = 500
    max_backoff_ms: int = 60_000


@dataclass(frozen=True, slots=True)
class TriggerSpec:
    name: str
    collection: str
    on: tuple[Op, ...]
    when: str
    action: Mapping[str, Any]
    batch_size: int = 1024
    retry: RetryPolicy = RetryPolicy()
    enabled: bool = True
    # Triggers ignore events made by other triggers' emit actions unless set.
    fire_on_derived: bool = False


@dataclass(frozen=True, slots=True)
class DlqConfig:
    max_entries: int = 100_000


@dataclass(frozen=True, slots=True)
class HealthConfig:
    # A stage (a CDC stream, the triggers, a handler) or the micro-batch path
    # that has failed, or been held, for this long without a commit is
    # stalled: /healthz, /v1/status, `eventplane status` and metrics say so.
    stall_after_s: float = 60.0
    # A stage that has not committed the batch it is on this long (an attempt
    # still running, or failed ones) is slow: health says so at once (503
    # naming the stage and what it waits for); the batches stop waiting for
    # an attempt that runs half this long. 5 s: five default batch
    # intervals, several times a healthy commit to S3, and a quarter of the
    # longest one S3 request may take with its retries (s3.request_worst_s,
    # (2 + 5) x 3 = 21 s by default), so a hung request shows long before
    # the attempt gives up.
    attempt_slow_s: float = 5.0
    # Failed attempts in a row to (re)build the Spark session before the
    # systemd watchdog is withheld, so that systemd restarts the process.
    session_restart_attempts: int = 5
    # A paused stage (eventplane pause) further behind than this many events
    # (an LSN distance) is a problem: /healthz 503 until it is resumed or
    # removed; nothing is dropped. 0: no limit. Keep it below
    # ingest.max_lag_events, which refuses producers (429) at the same measure.
    paused_max_lag_events: int = 10_000_000


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: LogLevel = "info"
    format: LogFormat = "auto"


@dataclass(frozen=True, slots=True)
class Config:
    daemon: DaemonConfig = DaemonConfig()
    ingest: IngestConfig = IngestConfig()
    admin: AdminConfig = AdminConfig()
    wal: WalConfig = WalConfig()
    consumer: ConsumerConfig = ConsumerConfig()
    spark: SparkConfig = SparkConfig()
    microbatch: MicrobatchConfig = MicrobatchConfig()
    cdc: CdcConfig = CdcConfig()
    triggers: tuple[TriggerSpec, ...] = ()
    dlq: DlqConfig = DlqConfig()
    health: HealthConfig = HealthConfig()
    log: LogConfig = LogConfig()
    s3: S3Config = S3Config()
    source: Path | None = None

    @property
    def data_dir(self) -> Path:
        return self.daemon.data_dir

    @property
    def wal_dir(self) -> Path:
        return self.daemon.data_dir / "wal"
