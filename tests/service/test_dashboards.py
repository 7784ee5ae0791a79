"""The Grafana dashboard and the alert rules: well-formed, and every eventplane
series they query exists in daemon.service.metrics (parsed from a real scrape)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.service.metrics import Metrics
from tests import requires

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "systemd" / "grafana-eventplane.json"
ALERTS = ROOT / "systemd" / "eventplane-alerts.yml"
OPERATING = ROOT / "docs" / "operating.md"
_NAME = re.compile(r"\beventplane_[a-z0-9_]+")


def exposed_series() -> dict[str, set[str]]:
    """Every sample name a scrape carries -> its label names (``le`` included).

    Every labelled family gets one child first, so each family has samples.
    """
    m = Metrics(cores=1)
    m.init_triggers(["t"])
    m.ingest_requests.labels(code="200")
    m.batch_outcomes.labels(outcome="committed")
    m.trigger_failures.labels(trigger="t", kind="timeout")
    m.trigger_paused_rows.labels(trigger="t")
    m.trigger_action_latency.labels(trigger="t")
    for family in (
        m.stage_stalled,
        m.stage_slow,
        m.stage_attempt_seconds,
        m.stage_stopped,
        m.stage_failing_seconds,
        m.stage_lag_batches,
        m.stage_lag_events,
        m.stage_paused,
        m.stage_paused_backlog_ratio,
        m.stage_failures,
        m.stage_backfill_remaining,
    ):
        family.labels(stage="cdc:all")
    m.cdc_compactions.labels(stream="all", outcome="done")
    m.cdc_retention_runs.labels(stream="all", outcome="ok")
    for family in (
        m.cdc_compaction_files_removed,
        m.cdc_compaction_seconds,
        m.cdc_table_files,
        m.cdc_retention_removed,
        m.cdc_quarantined_rows,
        m.cdc_quarantined,
    ):
        family.labels(stream="all")
    m.mirror_quarantined_rows.labels(mirror="orders")
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


@pytest.fixture(scope="module")
def series() -> dict[str, set[str]]:
    return exposed_series()


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    for ann in dashboard["annotations"]["list"]:
        if "expr" in ann:
            found.append((ann["name"], ann["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            found.append((var["name"], var["definition"]))
    return found


def _alert_rules() -> list[dict[str, str]]:
    """The rules of the alert file, read with a scanner for the subset of YAML it
    uses (no YAML parser is a dependency); PyYAML or promtool, when present,
    check it properly in the tests below."""
    text = ALERTS.read_text()
    assert "\t" not in text
    rules: list[dict[str, str]] = []
    for block in re.split(r"\n      - alert: ", text)[1:]:
        name, _, body = block.partition("\n")
        rule = {"alert": name.strip()}
        expr = re.search(r"\n        expr: (?:>-\n((?:          .*\n)+)|(.*)\n)", "\n" + body)
        assert expr, f"{name}: no expr"
        rule["expr"] = " ".join((expr.group(1) or expr.group(2)).split())
        for key in ("for", "severity", "summary", "description", "runbook"):
            m = re.search(rf"\n\s+{key}: (.*)", "\n" + body)
            if m:
                rule[key] = m.group(1).strip()
        rules.append(rule)
    return rules


# -- dashboard -------------------------------------------------------------------


def test_dashboard_is_grafana_json_with_unique_panels(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] == "eventplane" and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_covers_what_operators_watch(dashboard: dict[str, Any]) -> None:
    queried = " ".join(expr for _title, expr in _exprs(dashboard))
    for name in (
        "eventplane_ingest_events_total",  # ingest rate
        "eventplane_ingest_ack_latency_seconds_bucket",  # ack latency
        "eventplane_consumer_mode",  # per-core mode
        "eventplane_consumer_lag_events",  # per-core lag
        "eventplane_consumer_catchup_entries_total",  # catch-up events
        "eventplane_microbatch_duration_seconds_bucket",  # batch duration
        "eventplane_trigger_action_failures_total",  # trigger failures
        "eventplane_dlq_entries",  # DLQ size
        "eventplane_stage_lag_events",  # a stage behind (failing, paused, backfilling)
        "eventplane_trigger_paused_rows",  # a paused trigger's queue
        "eventplane_cdc_table_files",  # small files piling up
        "eventplane_cdc_compactions_total",  # compaction outcomes
        "eventplane_cdc_retention_runs_total",  # retention outcomes
    ):
        assert name in queried, name


def test_every_dashboard_series_exists(
    dashboard: dict[str, Any], series: dict[str, set[str]]
) -> None:
    for title, expr in _exprs(dashboard):
        for name in _NAME.findall(expr):
            assert name in series, f"panel {title!r} queries unknown series {name}"


def test_dashboard_groups_only_by_labels_the_series_has(
    dashboard: dict[str, Any], series: dict[str, set[str]]
) -> None:
    scrape_labels = {"instance", "job"}  # added by Prometheus, not the daemon
    for title, expr in _exprs(dashboard):
        names = _NAME.findall(expr)
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                if label not in scrape_labels:
                    assert any(label in series.get(n, set()) for n in names), (title, label)


def test_the_operating_guide_documents_every_series_with_its_help() -> None:
    guide = OPERATING.read_text()
    for family in text_string_to_metric_families(Metrics().render().decode()):
        if not family.name.startswith("eventplane_") or family.name.endswith("_created"):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        row = re.search(rf"^\| `{name}` \| {family.type} \|.*\| (.*) \|$", guide, re.M)
        assert row, f"{name} is not in the metrics table of docs/operating.md"
        assert row.group(1) == family.documentation, name


# -- alerts ----------------------------------------------------------------------


def test_alert_rules_cover_lag_catchup_dlq_and_watchdog() -> None:
    rules = {r["alert"]: r for r in _alert_rules()}
    for name in (
        "EventplaneDown",
        "EventplaneUnhealthy",  # watchdog pings withheld
        "EventplaneRestarting",  # watchdog aborts / fail-stops
        "EventplaneLagGrowing",
        "EventplaneCoreStuckInCatchup",
        "EventplaneDLQGrowing",
    ):
        assert name in rules, name
    for rule in rules.values():
        assert rule["severity"] in ("warning", "critical"), rule["alert"]
        assert rule.get("summary") and rule.get("description"), rule["alert"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]


def test_every_alert_series_exists(series: dict[str, set[str]]) -> None:
    for rule in _alert_rules():
        for name in _NAME.findall(rule["expr"]):
            assert name in series, f"alert {rule['alert']} uses unknown series {name}"


def test_alert_runbooks_point_at_headings_of_the_operating_guide() -> None:
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", OPERATING.read_text(), re.M)}
    for rule in _alert_rules():
        page, _, anchor = rule["runbook"].partition("#")
        assert page == "docs/operating.md", rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: no heading for #{anchor}"


def _anchor(heading: str) -> str:
    # GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes.
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_alert_file_parses_as_prometheus_rule_groups() -> None:
    import yaml

    doc = yaml.safe_load(ALERTS.read_text())
    (group,) = doc["groups"]
    scanned = _alert_rules()
    assert [r["alert"] for r in group["rules"]] == [r["alert"] for r in scanned]
    for parsed, ours in zip(group["rules"], scanned, strict=True):
        assert " ".join(parsed["expr"].split()) == ours["expr"]


def _promtool() -> str:
    return requires.command("promtool", "Debian package `prometheus` (.ci/run installs it)")


def test_promtool_accepts_the_alert_rules() -> None:
    proc = subprocess.run(
        [_promtool(), "check", "rules", str(ALERTS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alerts_fire_on_a_troubled_daemon_and_stay_quiet_on_a_healthy_one() -> None:
    """promtool evaluates the rules over synthetic series (see the scenario file):
    lag growing, a core stuck in catch-up, DLQ growth, health and restarts."""
    scenarios = Path(__file__).with_name("eventplane-alerts.promtool.yml")
    proc = subprocess.run(
        [_promtool(), "test", "rules", scenarios.name],
        cwd=scenarios.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
