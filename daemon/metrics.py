"""Every Prometheus series of the daemon, in one place (a contract: docs/operating.md, "Metrics").

Names follow Prometheus conventions: prefix ``eventplane_``, ``_total`` on
counters, base units (``_seconds``, ``_bytes``), a ``core`` label (the core
number as a string) on per-core series. Each daemon owns one ``Metrics`` with
its own registry, so tests and several daemons in one process never share
state. ``docs/operating.md`` lists every series; the Grafana dashboard and
the alert rules in ``systemd/`` use only names defined here (a test checks).

Enumerations are exported as numbers so they graph and alert well; the
mappings below are the contract between producers, the dashboard and alerts.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

# Latency buckets from 100 µs (a group commit on a fast NVMe) to 10 s (a stalled disk).
_LATENCY = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Batch durations: Spark jobs take 50 ms at best on local[*] and minutes at worst.
_BATCH = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

PREFIX: Final = "eventplane_"

# eventplane_consumer_mode values.
MODE_VALUES: Final = {"normal": 0, "catchup": 1}
# eventplane_backpressure_state values (and the ``to`` label of its transitions).
BACKPRESSURE_VALUES: Final = {"normal": 0, "throttled": 1, "suspended": 2}
# ``reason`` label of eventplane_consumer_catchup_entries_total (STYLE.md mode machine).
CATCHUP_REASONS: Final = ("boot", "gap", "tail_drop", "backpressure", "memory")


def _version() -> str:
    try:
        return metadata.version("eventplane")
    except metadata.PackageNotFoundError:  # running from a checkout without install
        return "unknown"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, cores: int = 0) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        p = PREFIX

        # Ingest
        self.ingest_requests = Counter(
            p + "ingest_requests_total",
            "Ingest HTTP requests answered, by response status code (200, 400, 413, 415, "
            "422, 429, 503).",
            ["code"],
            registry=r,
        )
        self.ingest_events = Counter(
            p + "ingest_events_total",
            "Events accepted and acknowledged as durable (counted when the 200 is sent).",
            registry=r,
        )
        self.ingest_replays = Counter(
            p + "ingest_replays_total",
            "Requests answered from an earlier request with the same Idempotency-Key "
            "and body (nothing stored again).",
            registry=r,
        )
        self.ingest_producer_events = Counter(
            p + "ingest_producer_events_total",
            "Events accepted from each producer of [[ingest.tokens]] (by its name).",
            ["producer"],
            registry=r,
        )
        self.ingest_quota_refusals = Counter(
            p + "ingest_quota_refusals_total",
            "Requests refused with 429 because the producer was over its "
            "max_events_per_s or max_bytes_per_s.",
            ["producer"],
            registry=r,
        )
        self.ingest_idempotency_keys = Gauge(
            p + "ingest_idempotency_keys",
            "Request keys in the de-duplication window (ingest.idempotency_max_keys bounds it).",
            registry=r,
        )
        self.ingest_bytes = Counter(
            p + "ingest_request_bytes_total", "Request body bytes read by ingest.", registry=r
        )
        self.ingest_ack_latency = Histogram(
            p + "ingest_ack_latency_seconds",
            "Time from the start of an ingest request to its durable acknowledgement "
            "(includes the WAL group commit and fsync).",
            buckets=_LATENCY,
            registry=r,
        )
        self.ingest_connections = Gauge(
            p + "ingest_connections", "Open ingest connections.", registry=r
        )

        # WAL
        self.wal_appends = Counter(
            p + "wal_appends_total", "Events appended to the WAL.", registry=r
        )
        self.wal_bytes = Counter(
            p + "wal_written_bytes_total",
            "Bytes written to WAL segments (frames included).",
            registry=r,
        )
        self.wal_groups = Counter(
            p + "wal_group_commits_total",
            "WAL group commits (one write and one fsync each).",
            registry=r,
        )
        self.wal_fsync_latency = Histogram(
            p + "wal_fsync_duration_seconds",
            "Duration of WAL fdatasync calls.",
            buckets=_LATENCY,
            registry=r,
        )
        self.wal_segments = Gauge(p + "wal_segments", "WAL segment files on disk.", registry=r)
        # The WAL archive ([wal.archive], docs/wal.md, "The archive"); zero without one.
        self.archive_lsn = Gauge(
            p + "wal_archived_lsn",
            "Last LSN the WAL archive holds (and every one below it).",
            registry=r,
        )
        self.archive_unarchived_bytes = Gauge(
            p + "wal_unarchived_bytes", "WAL bytes durable here but not yet archived.", registry=r
        )
        self.archive_unarchived_age = Gauge(
            p + "wal_unarchived_age_seconds",
            "Age of the oldest durable group not yet archived (0: all archived).",
            registry=r,
        )
        self.archive_upload_latency = Histogram(
            p + "wal_archive_upload_seconds",
            "Duration of one archive object's successful PUT.",
            buckets=_LATENCY,
            registry=r,
        )
        self.archive_puts = Counter(
            p + "wal_archive_puts_total",
            "Archive PUTs by result: ok, error (retried), fenced, fence (a fence object written).",
            ["result"],
            registry=r,
        )
        self.archive_uploaded_bytes = Counter(
            p + "wal_archive_uploaded_bytes_total", "Bytes of archive objects stored.", registry=r
        )
        self.archive_epoch = Gauge(
            p + "wal_archive_epoch", "This daemon's epoch in the archive's manifest.", registry=r
        )
        self.archive_fenced = Gauge(
            p + "wal_archive_fenced",
            "1 once a newer holder fenced this daemon out of the archive (it acks nothing).",
            registry=r,
        )
        # A standby ([wal.archive] role = "standby", docs/operating.md, "A standby").
        self.standby_followed_lsn = Gauge(
            p + "standby_followed_lsn",
            "Last LSN of the archive a standby holds in its data_dir (0: a primary).",
            registry=r,
        )
        self.standby_lag_lsns = Gauge(
            p + "standby_lag_lsns",
            "LSNs the archive held that the standby had not, at its last poll.",
            registry=r,
        )
        self.standby_lag_seconds = Gauge(
            p + "standby_lag_seconds",
            "Age of the oldest archive object the standby had not, at its last poll.",
            registry=r,
        )
        self.standby_takeovers = Counter(
            p + "standby_takeovers_total",
            "Takeovers: this standby restored the archive and became its primary.",
            registry=r,
        )
        self.wal_head_lsn = Gauge(p + "wal_head_lsn", "Last durable LSN in the WAL.", registry=r)
        self.wal_floor_lsn = Gauge(
            p + "wal_retained_floor_lsn",
            "Lowest LSN still retained in the WAL (segments below it were removed).",
            registry=r,
        )
        self.wal_lost_lsns = Gauge(
            p + "wal_lost_lsns",
            "LSNs the retained WAL records as lost: a restore found them in tables, "
            "not in the archive (ack = local).",
            registry=r,
        )

        # Rings and backpressure
        self.ring_utilization = Gauge(
            p + "ring_utilization_ratio",
            "Ring fill by event count, 0 to 1 (Throttled at 0.85, Suspended at 0.95).",
            ["core"],
            registry=r,
        )
        self.ring_bytes = Gauge(
            p + "ring_bytes", "Payload bytes held in the core's ring.", ["core"], registry=r
        )
        self.ring_drops = Counter(
            p + "ring_dropped_events_total",
            "Events not put in the ring because it was full; the consumer catches them up "
            "from the WAL (nothing is lost).",
            ["core"],
            registry=r,
        )
        self.backpressure_state = Gauge(
            p + "backpressure_state",
            "Backpressure state of the core: 0 normal, 1 throttled, 2 suspended.",
            ["core"],
            registry=r,
        )
        self.backpressure_transitions = Counter(
            p + "backpressure_transitions_total",
            "Backpressure state changes, by the state entered (normal, throttled, suspended).",
            ["core", "to"],
            registry=r,
        )

        # Consumers
        self.consumer_mode = Gauge(
            p + "consumer_mode",
            "Consumer mode of the core: 0 normal (ring), 1 catch-up (WAL).",
            ["core"],
            registry=r,
        )
        self.catchup_entries = Counter(
            p + "consumer_catchup_entries_total",
            "Switches into catch-up mode, by reason (boot, gap, tail_drop, backpressure, memory).",
            ["core", "reason"],
            registry=r,
        )
        self.replayed_events = Counter(
            p + "consumer_replayed_events_total",
            "Events delivered from WAL replay (catch-up).",
            ["core"],
            registry=r,
        )
        self.delivered_events = Counter(
            p + "consumer_delivered_events_total",
            "Events delivered to micro-batch slices (ring and replay).",
            ["core"],
            registry=r,
        )
        self.watermark_lsn = Gauge(
            p + "watermark_lsn",
            "The core's watermark: last LSN whose micro-batch effects all committed.",
            ["core"],
            registry=r,
        )
        self.lag_events = Gauge(
            p + "consumer_lag_events",
            "WAL head LSN minus the core's watermark (an upper bound on its undelivered events).",
            ["core"],
            registry=r,
        )

        # Micro-batches
        self.batch_duration = Histogram(
            p + "microbatch_duration_seconds",
            "Wall time of one micro-batch attempt, from plan to commit.",
            buckets=_BATCH,
            registry=r,
        )
        self.batch_rows = Counter(
            p + "microbatch_rows_total", "Rows in committed micro-batches.", registry=r
        )
        self.batch_outcomes = Counter(
            p + "microbatch_outcomes_total",
            "Micro-batch attempts, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.batch_last_id = Gauge(
            p + "microbatch_last_committed_id", "Id of the last committed micro-batch.", registry=r
        )
        self.batch_last_commit_time = Gauge(
            p + "microbatch_last_commit_timestamp_seconds",
            "Unix time of the last micro-batch commit (0 until the first one).",
            registry=r,
        )

        self.spark_session_rebuilds = Counter(
            p + "spark_session_rebuilds_total",
            "Spark sessions rebuilt after the previous one was lost "
            "(its driver JVM died or its SparkContext stopped).",
            registry=r,
        )

        # CDC compaction (daemon/table/compact.py)
        self.cdc_compactions = Counter(
            p + "cdc_compactions_total",
            "CDC compactions (one partition folder each), by outcome (done, failed).",
            ["stream", "outcome"],
            registry=r,
        )
        self.cdc_compaction_files_removed = Counter(
            p + "cdc_compaction_files_removed_total",
            "Data files a CDC compaction took out of a table (inputs minus merged outputs).",
            ["stream"],
            registry=r,
        )
        self.cdc_compaction_seconds = Histogram(
            p + "cdc_compaction_seconds",
            "Wall time of one compaction run of a stream (planning, Spark job, swap, clean).",
            ["stream"],
            buckets=_BATCH,
            registry=r,
        )
        self.cdc_table_files = Gauge(
            p + "cdc_table_files",
            "Data files in a CDC table at the compaction service's last look.",
            ["stream"],
            registry=r,
        )

        # Stages: each CDC stream, the triggers, each handler (per-stage progress)
        self.stage_batch_id = Gauge(
            p + "stage_committed_batch_id",
            "Id of the last micro-batch the stage committed.",
            ["stage"],
            registry=r,
        )
        self.stage_lag_batches = Gauge(
            p + "stage_lag_batches",
            "Micro-batches the stage is behind the newest one (0: keeping up).",
            ["stage"],
            registry=r,
        )
        self.stage_failures = Counter(
            p + "stage_failures_total",
            "Failed attempts of a stage on a micro-batch (each is retried with backoff).",
            ["stage"],
            registry=r,
        )
        self.stage_failing_seconds = Gauge(
            p + "stage_failing_seconds",
            "How long the stage has been failing without a commit in between (0: healthy).",
            ["stage"],
            registry=r,
        )
        self.stage_stalled = Gauge(
            p + "stage_stalled",
            "1 while the stage is stalled: failing for longer than health.stall_after_s.",
            ["stage"],
            registry=r,
        )
        self.stage_slow = Gauge(
            p + "stage_slow",
            "1 while the stage has not committed the batch it is on within "
            "health.attempt_slow_s; the other stages go on without it.",
            ["stage"],
            registry=r,
        )
        self.stage_attempt_seconds = Gauge(
            p + "stage_attempt_seconds",
            "How long the stage has been trying the batch it is on (0: none to do).",
            ["stage"],
            registry=r,
        )
        self.stage_stopped = Gauge(
            p + "stage_stopped",
            "1 while the stage is stopped by an error retrying cannot cure; "
            "eventplane resume retries it after the fix.",
            ["stage"],
            registry=r,
        )
        self.stage_lag_events = Gauge(
            p + "stage_lag_events",
            "Events from the first event of the oldest batch the stage has not committed "
            "to the WAL head, an LSN distance (0: keeping up).",
            ["stage"],
            registry=r,
        )
        self.stage_paused = Gauge(
            p + "stage_paused",
            "1 while an operator has the stage paused (eventplane pause): it runs no "
            "batches and the WAL keeps everything it has not committed.",
            ["stage"],
            registry=r,
        )
        self.stage_paused_backlog_ratio = Gauge(
            p + "stage_paused_backlog_ratio",
            "A paused stage's lag in events over health.paused_max_lag_events; above 1 "
            "the daemon is unhealthy (0 when not paused or no limit).",
            ["stage"],
            registry=r,
        )

        self.stage_backfill_remaining = Gauge(
            p + "stage_backfill_remaining_events",
            "Events a new CDC stream still has to fill from the WAL before it joins the "
            "live batches, an LSN distance (an upper bound; 0 when not backfilling).",
            ["stage"],
            registry=r,
        )

        # Triggers
        self.trigger_fires = Counter(
            p + "trigger_fires_total",
            "Rows matched by a trigger's when-condition.",
            ["trigger"],
            registry=r,
        )
        self.trigger_successes = Counter(
            p + "trigger_action_successes_total",
            "Trigger action calls that succeeded.",
            ["trigger"],
            registry=r,
        )
        self.trigger_failures = Counter(
            p + "trigger_action_failures_total",
            "Trigger action calls that failed, by kind of failure.",
            ["trigger", "kind"],
            registry=r,
        )
        self.trigger_action_latency = Histogram(
            p + "trigger_action_duration_seconds",
            "Duration of one trigger action call.",
            ["trigger"],
            buckets=_LATENCY,
            registry=r,
        )
        self.trigger_paused_rows = Gauge(
            p + "trigger_paused_rows",
            "Rows a paused trigger holds in the retry queue (0 when it is not paused); "
            "see `eventplane resume trigger:<name>`.",
            ["trigger"],
            registry=r,
        )
        self.retry_depth = Gauge(
            p + "trigger_retry_queue_depth",
            "Trigger actions waiting in the durable retry queue.",
            registry=r,
        )
        self.dlq_entries = Gauge(
            p + "dlq_entries",
            "Trigger actions in the dead-letter queue (retries exhausted); see "
            "`eventplane dlq list`.",
            registry=r,
        )
        self.dlq_evicted = Counter(
            p + "dlq_evicted_total",
            "DLQ entries evicted (oldest first) by dlq.max_entries.",
            registry=r,
        )

        # Service
        self.up_seconds = Gauge(
            p + "start_time_seconds",
            "Unix time the daemon process started (a change means a restart).",
            registry=r,
        )
        self.up_seconds.set_to_current_time()
        self.healthy = Gauge(
            p + "healthy",
            "Whether the daemon is healthy (1) or not (0): a stage stalled or a component "
            "failed; `eventplane status` and /healthz say which.",
            registry=r,
        )
        self.ready = Gauge(
            p + "ready",
            "Whether the daemon is ready (1: WAL open, listeners bound, not draining) or not (0).",
            registry=r,
        )
        self.build_info = Gauge(
            p + "build_info",
            "Always 1; labels carry the eventplane and Python versions.",
            ["version", "python"],
            registry=r,
        )
        self.build_info.labels(version=_version(), python=platform.python_version()).set(1)

        self.cdc_quarantined_rows = Gauge(
            p + "cdc_quarantine_rows",
            "Rows in a CDC stream's quarantine: rows it could not write, set aside "
            '(docs/cdc.md, "Quarantine"). Not 0: see eventplane cdc quarantine list.',
            ["stream"],
            registry=r,
        )
        self.cdc_commit_retries = Counter(
            p + "cdc_commit_retries_total",
            "Commits of a CDC stream's batch tried again because another commit took "
            "the Delta version first (another daemon's, in a shared table: docs/cdc.md, \"Shared "
            'tables"), since the daemon started.',
            ["stream"],
            registry=r,
        )
        self.mirror_cast_failures = Counter(
            p + "mirror_cast_failures_total",
            "Values of a mirror's typed column that did not fit its type (the column is "
            "null, doc keeps the value), since the daemon started.",
            ["mirror", "column"],
            registry=r,
        )
        self.mirror_quarantined_rows = Gauge(
            p + "mirror_quarantine_rows",
            "Events in a strict mirror's quarantine: events that did not fit its typed "
            'columns, set aside (docs/cdc.md, "Mirror tables"). Not 0: see eventplane cdc '
            "mirror quarantine list.",
            ["mirror"],
            registry=r,
        )
        self.cdc_quarantined = Counter(
            p + "cdc_quarantined_rows_total",
            "Rows a CDC stream set aside in its quarantine since the daemon started.",
            ["stream"],
            registry=r,
        )
        self.cdc_retention_removed = Counter(
            p + "cdc_retention_removed_partitions_total",
            "Time partitions of a CDC stream removed by its retention (docs/cdc.md, "
            '"Time partitioning and retention").',
            ["stream"],
            registry=r,
        )
        self.cdc_retention_runs = Counter(
            p + "cdc_retention_runs_total",
            "Retention runs of a CDC stream, by outcome (ok, failed).",
            ["stream", "outcome"],
            registry=r,
        )
        # process_* series (memory, CPU, open fds) for this registry; Linux /proc only.
        ProcessCollector(registry=r)

        if cores:
            self.init_cores(cores)

    def init_cores(self, cores: int) -> None:
        """Create every per-core series at zero, so dashboards and alerts see all
        cores from the first scrape (not only those that had an event)."""
        for i in range(cores):
            core = str(i)
            for family in (
                self.ring_utilization,
                self.ring_bytes,
                self.ring_drops,
                self.backpressure_state,
                self.consumer_mode,
                self.replayed_events,
                self.delivered_events,
                self.watermark_lsn,
                self.lag_events,
            ):
                family.labels(core=core)
            for reason in CATCHUP_REASONS:
                self.catchup_entries.labels(core=core, reason=reason)
            for state in BACKPRESSURE_VALUES:
                self.backpressure_transitions.labels(core=core, to=state)

    def init_triggers(self, names: Iterable[str]) -> None:
        """Create each trigger's series at zero (call at start-up and after a reload)."""
        for name in names:
            self.trigger_fires.labels(trigger=name)
            self.trigger_successes.labels(trigger=name)
            self.trigger_action_latency.labels(trigger=name)
            self.trigger_paused_rows.labels(trigger=name)

    def bind_health(self, healthy: Callable[[], bool], ready: Callable[[], bool]) -> None:
        """Read ``eventplane_healthy`` and ``eventplane_ready`` from the daemon at scrape time."""
        self.healthy.set_function(lambda: 1.0 if healthy() else 0.0)
        self.ready.set_function(lambda: 1.0 if ready() else 0.0)

    def render(self) -> bytes:
        """The Prometheus text exposition (what ``GET /metrics`` serves)."""
        return generate_latest(self.registry)
