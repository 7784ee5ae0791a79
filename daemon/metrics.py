"""Every Prometheus series of the daemon, in one place (DESIGN.md, contract).

Names follow Prometheus conventions: prefix ``eventplane_``, ``_total`` on
counters, base units (``_seconds``, ``_bytes``), ``core`` labels on per-core
series. Each daemon owns one ``Metrics`` with its own registry, so tests and
several daemons in one process never share state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from 100 µs (a group commit on a fast NVMe) to 10 s (a stalled disk).
_LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
            0.5, 1.0, 2.5, 5.0, 10.0)
# Batch durations: Spark jobs take 50 ms at best on local[*] and minutes at worst.
_BATCH = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

PREFIX = "eventplane_"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        p = PREFIX

        # Ingest
        self.ingest_requests = Counter(
            p + "ingest_requests_total", "Ingest HTTP requests by response status code.",
            ["code"], registry=r)
        self.ingest_events = Counter(
            p + "ingest_events_total", "Events accepted and acknowledged as durable.",
            registry=r)
        self.ingest_bytes = Counter(
            p + "ingest_request_bytes_total", "Request body bytes read by ingest.", registry=r)
        self.ingest_ack_latency = Histogram(
            p + "ingest_ack_latency_seconds",
            "Time from request start to the durable acknowledgement.",
            buckets=_LATENCY, registry=r)
        self.ingest_connections = Gauge(
            p + "ingest_connections", "Open ingest connections.", registry=r)

        # WAL
        self.wal_appends = Counter(
            p + "wal_appends_total", "Events appended to the WAL.", registry=r)
        self.wal_bytes = Counter(
            p + "wal_written_bytes_total", "Bytes written to WAL segments.", registry=r)
        self.wal_groups = Counter(
            p + "wal_group_commits_total", "Group commits (one write + one fsync each).",
            registry=r)
        self.wal_fsync_latency = Histogram(
            p + "wal_fsync_duration_seconds", "Duration of WAL fdatasync calls.",
            buckets=_LATENCY, registry=r)
        self.wal_segments = Gauge(
            p + "wal_segments", "WAL segment files on disk.", registry=r)
        self.wal_head_lsn = Gauge(
            p + "wal_head_lsn", "Last durable LSN in the WAL.", registry=r)
        self.wal_floor_lsn = Gauge(
            p + "wal_retained_floor_lsn", "Lowest LSN still retained in the WAL.", registry=r)

        # Rings and backpressure
        self.ring_utilization = Gauge(
            p + "ring_utilization_ratio", "Ring fill by count, 0..1.", ["core"], registry=r)
        self.ring_bytes = Gauge(
            p + "ring_bytes", "Payload bytes held in the ring.", ["core"], registry=r)
        self.ring_drops = Counter(
            p + "ring_dropped_events_total", "Events dropped because the ring was full.",
            ["core"], registry=r)
        self.backpressure_state = Gauge(
            p + "backpressure_state", "Backpressure: 0 normal, 1 throttled, 2 suspended.",
            ["core"], registry=r)
        self.backpressure_transitions = Counter(
            p + "backpressure_transitions_total", "Backpressure state changes.",
            ["core", "to"], registry=r)

        # Consumers
        self.consumer_mode = Gauge(
            p + "consumer_mode", "Consumer mode: 0 normal, 1 catch-up.", ["core"], registry=r)
        self.catchup_entries = Counter(
            p + "consumer_catchup_entries_total", "Switches into catch-up, by reason.",
            ["core", "reason"], registry=r)
        self.replayed_events = Counter(
            p + "consumer_replayed_events_total", "Events delivered from WAL replay.",
            ["core"], registry=r)
        self.delivered_events = Counter(
            p + "consumer_delivered_events_total", "Events delivered to micro-batch slices.",
            ["core"], registry=r)
        self.watermark_lsn = Gauge(
            p + "watermark_lsn", "Last LSN whose batch committed.", ["core"], registry=r)
        self.lag_events = Gauge(
            p + "consumer_lag_events", "WAL head minus the core's watermark (upper bound).",
            ["core"], registry=r)

        # Micro-batches
        self.batch_duration = Histogram(
            p + "microbatch_duration_seconds", "Wall time of a micro-batch, plan to commit.",
            buckets=_BATCH, registry=r)
        self.batch_rows = Counter(
            p + "microbatch_rows_total", "Rows in committed micro-batches.", registry=r)
        self.batch_outcomes = Counter(
            p + "microbatch_outcomes_total", "Micro-batch attempts by outcome.",
            ["outcome"], registry=r)
        self.batch_last_id = Gauge(
            p + "microbatch_last_committed_id", "Id of the last committed micro-batch.",
            registry=r)

        # Triggers
        self.trigger_fires = Counter(
            p + "trigger_fires_total", "Rows matched by a trigger.", ["trigger"], registry=r)
        self.trigger_successes = Counter(
            p + "trigger_action_successes_total", "Action calls that succeeded.",
            ["trigger"], registry=r)
        self.trigger_failures = Counter(
            p + "trigger_action_failures_total", "Action calls that failed, by kind.",
            ["trigger", "kind"], registry=r)
        self.trigger_action_latency = Histogram(
            p + "trigger_action_duration_seconds", "Duration of one action call.",
            ["trigger"], buckets=_LATENCY, registry=r)
        self.retry_depth = Gauge(
            p + "trigger_retry_queue_depth", "Entries waiting in the durable retry queue.",
            registry=r)
        self.dlq_entries = Gauge(
            p + "dlq_entries", "Entries in the dead-letter queue.", registry=r)
        self.dlq_evicted = Counter(
            p + "dlq_evicted_total", "DLQ entries evicted (oldest first) by the size cap.",
            registry=r)

        # Service
        self.up_seconds = Gauge(
            p + "start_time_seconds", "Unix time the daemon started.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
