"""Every documented series (docs/operating.md), scraped and parsed by prometheus_client."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from daemon.service.metrics import BACKPRESSURE_VALUES, CATCHUP_REASONS, Metrics

# docs/operating.md "Metrics": (family name as the parser reports it, type, label names).
# The parser drops ``_total`` from counter family names; samples keep it.
DESIGN_SERIES: list[tuple[str, str, frozenset[str]]] = [
    # ingest requests/events/ack latency
    ("eventplane_ingest_requests", "counter", frozenset({"code"})),
    ("eventplane_ingest_events", "counter", frozenset()),
    ("eventplane_ingest_ack_latency_seconds", "histogram", frozenset()),
    # WAL appends/bytes/fsync latency/segments
    ("eventplane_wal_appends", "counter", frozenset()),
    ("eventplane_wal_written_bytes", "counter", frozenset()),
    ("eventplane_wal_fsync_duration_seconds", "histogram", frozenset()),
    ("eventplane_wal_segments", "gauge", frozenset()),
    # ring utilization and drops
    ("eventplane_ring_utilization_ratio", "gauge", frozenset({"core"})),
    ("eventplane_ring_dropped_events", "counter", frozenset({"core"})),
    # backpressure state and transitions
    ("eventplane_backpressure_state", "gauge", frozenset({"core"})),
    ("eventplane_backpressure_transitions", "counter", frozenset({"core", "to"})),
    # consumer mode, catch-up entries (by reason) and replayed events
    ("eventplane_consumer_mode", "gauge", frozenset({"core"})),
    ("eventplane_consumer_catchup_entries", "counter", frozenset({"core", "reason"})),
    ("eventplane_consumer_replayed_events", "counter", frozenset({"core"})),
    # watermark LSN, lag
    ("eventplane_watermark_lsn", "gauge", frozenset({"core"})),
    ("eventplane_consumer_lag_events", "gauge", frozenset({"core"})),
    # micro-batch duration/rows/outcomes
    ("eventplane_microbatch_duration_seconds", "histogram", frozenset()),
    ("eventplane_microbatch_rows", "counter", frozenset()),
    ("eventplane_microbatch_outcomes", "counter", frozenset({"outcome"})),
    # trigger fires/failures/retry depth, DLQ entries
    ("eventplane_trigger_fires", "counter", frozenset({"trigger"})),
    ("eventplane_trigger_action_failures", "counter", frozenset({"trigger", "kind"})),
    ("eventplane_trigger_retry_queue_depth", "gauge", frozenset()),
    ("eventplane_dlq_entries", "gauge", frozenset()),
    # service
    ("eventplane_start_time_seconds", "gauge", frozenset()),
    ("eventplane_healthy", "gauge", frozenset()),
    ("eventplane_ready", "gauge", frozenset()),
]


def _scrape(m: Metrics) -> dict[str, tuple[str, str, list[Sample]]]:
    text = m.render().decode()
    return {
        f.name: (f.type, f.documentation, f.samples) for f in text_string_to_metric_families(text)
    }


@pytest.fixture
def scraped() -> dict[str, tuple[str, str, list[Sample]]]:
    m = Metrics(cores=2)
    m.init_triggers(["large-orders"])
    # One child of every labelled family whose label values producers choose.
    m.ingest_requests.labels(code="200").inc()
    m.batch_outcomes.labels(outcome="committed").inc()
    m.trigger_failures.labels(trigger="large-orders", kind="timeout").inc()
    return _scrape(m)


@pytest.mark.parametrize(
    ("name", "kind", "labels"), DESIGN_SERIES, ids=[s[0] for s in DESIGN_SERIES]
)
def test_every_design_series_is_exposed_with_type_help_and_labels(
    scraped: dict[str, tuple[str, str, list[Sample]]], name: str, kind: str, labels: frozenset[str]
) -> None:
    assert name in scraped, f"{name} missing from /metrics"
    got_kind, doc, samples = scraped[name]
    assert got_kind == kind
    assert len(doc) >= 15 and doc[0].isupper() and doc.endswith((".", ")")), doc
    assert samples, f"{name} has no samples to check labels on"
    for s in samples:
        assert set(s.labels) - {"le"} == labels, (s.name, s.labels)
        if kind == "counter":
            assert s.name == name + "_total"
        if kind == "histogram":
            assert s.name in {name + "_bucket", name + "_sum", name + "_count"}


def test_names_follow_prometheus_conventions() -> None:
    families = _scrape(Metrics(cores=1))
    for name, (kind, _doc, _samples) in families.items():
        if name.startswith("process_"):
            continue
        assert name.startswith("eventplane_"), name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        if kind == "counter":  # the sample carries _total; the family name must not double it
            assert not name.endswith("_total"), name
        # Base units only: seconds and bytes, never ms/kb/percent.
        assert not re.search(r"_(ms|milliseconds|kb|mb|percent)\b", name), name


def test_every_core_is_visible_from_the_first_scrape() -> None:
    families = _scrape(Metrics(cores=3))
    _kind, _doc, samples = families["eventplane_consumer_mode"]
    assert sorted(s.labels["core"] for s in samples) == ["0", "1", "2"]
    _kind, _doc, samples = families["eventplane_consumer_catchup_entries"]
    totals = [s for s in samples if s.name.endswith("_total")]
    assert {s.labels["reason"] for s in totals} == set(CATCHUP_REASONS)
    _kind, _doc, samples = families["eventplane_backpressure_transitions"]
    assert {s.labels["to"] for s in samples if s.name.endswith("_total")} == set(
        BACKPRESSURE_VALUES
    )


def test_health_and_readiness_are_read_at_scrape_time() -> None:
    m = Metrics()
    state = {"healthy": True, "ready": False}
    m.bind_health(lambda: state["healthy"], lambda: state["ready"])

    def value(name: str) -> float:
        return _scrape(m)[name][2][0].value

    assert (value("eventplane_healthy"), value("eventplane_ready")) == (1.0, 0.0)
    state.update(healthy=False, ready=True)
    assert (value("eventplane_healthy"), value("eventplane_ready")) == (0.0, 1.0)


def test_build_info_and_start_time_are_set_at_construction() -> None:
    families = _scrape(Metrics())
    _kind, _doc, samples = families["eventplane_build_info"]
    assert samples[0].value == 1.0 and set(samples[0].labels) == {"version", "python"}
    assert families["eventplane_start_time_seconds"][2][0].value > 1.6e9


def test_two_daemons_in_one_process_do_not_share_series() -> None:
    a, b = Metrics(), Metrics()
    a.ingest_events.inc(5)
    assert _scrape(b)["eventplane_ingest_events"][2][0].value == 0.0
