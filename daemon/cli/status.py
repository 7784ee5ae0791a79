"""``eventplane status [--url URL] [--json]``: the daemon's state from ``/v1/status``.

Prints a table (per core: mode, watermark, lag, ring fill, backpressure,
catch-up progress; WAL head and floor; last batch; Spark; DLQ and retry
queue), or with ``--json`` the document itself. The document's shape is the
contract written down in ``docs/operating.md`` ("The /v1/status document");
unknown keys are ignored and missing ones shown as ``-``.

Exit codes (LSB ``status`` style, so scripts and monitors can tell them apart):
0 healthy · 1 reachable but not healthy (or an unreadable answer) ·
3 not reachable (daemon not running, wrong URL). 2 stays the CLI's usage/config code.

Only the standard library is imported: the command answers in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from daemon.cli.access import NO_ACCESS, Access
from daemon.config import Config

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1
EXIT_UNREACHABLE = 3
STATUS_PATH = "/v1/status"
# Long enough for a daemon busy in a big catch-up; short enough for a shell prompt.
DEFAULT_TIMEOUT_S = 5.0


class StatusUnavailable(Exception):
    """The admin API could not be reached or did not answer with a status document."""

    def __init__(self, message: str, *, reachable: bool) -> None:
        super().__init__(message)
        self.reachable = reachable


def admin_url(cfg: Config, url: str | None = None) -> str:
    """The ``/v1/status`` URL: ``--url`` if given, else from ``admin.listen``.

    A wildcard listen address is reached through loopback; a listener with
    ``[admin] tls_cert`` through https.
    """
    if url:
        base = url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            base = "http://" + base
        return base if base.endswith(STATUS_PATH) else base + STATUS_PATH
    host = cfg.admin.listen.host
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if cfg.admin.tls.enabled else "http"
    return f"{scheme}://{host}:{cfg.admin.listen.port}{STATUS_PATH}"


def fetch(
    url: str, timeout: float = DEFAULT_TIMEOUT_S, access: Access = NO_ACCESS
) -> dict[str, Any]:
    """GET the status document. Non-2xx answers that carry one are returned too
    (an admin API may answer 503 with the document of an unhealthy daemon)."""
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with access.urlopen(request, timeout) as resp:
            body: bytes = resp.read()
            code = int(resp.status)
    except urllib.error.HTTPError as exc:
        body, code = exc.read(), exc.code
        exc.close()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusUnavailable(f"cannot reach {url}: {reason}", reachable=False) from exc
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise StatusUnavailable(
            f"{url} answered HTTP {code} without a JSON status document", reachable=True
        ) from exc
    if not isinstance(doc, dict):
        raise StatusUnavailable(f"{url} answered HTTP {code} with a non-object", reachable=True)
    if code >= 400 and "healthy" not in doc:
        # An error document (e.g. 500 {"error", "message"}): show the daemon's words.
        detail = doc.get("message") or doc.get("error") or "no status document"
        raise StatusUnavailable(f"{url} answered HTTP {code}: {detail}", reachable=True)
    return doc


def main(
    args: argparse.Namespace, cfg: Config, out: TextIO | None = None, access: Access = NO_ACCESS
) -> int:
    out = sys.stdout if out is None else out
    url = admin_url(cfg, getattr(args, "url", None))
    timeout = float(getattr(args, "timeout", None) or DEFAULT_TIMEOUT_S)
    try:
        doc = fetch(url, timeout, access)
    except StatusUnavailable as exc:
        print(f"eventplane status: {exc}", file=sys.stderr)
        if not exc.reachable:
            print(
                "  Is the daemon running? `systemctl status eventplane`, and check "
                "[admin] listen in the config (or pass --url).",
                file=sys.stderr,
            )
            return EXIT_UNREACHABLE
        return EXIT_UNHEALTHY
    if getattr(args, "json", False):
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        out.write(render(doc, url))
    return EXIT_HEALTHY if doc.get("healthy") is True else EXIT_UNHEALTHY


# -- rendering ---------------------------------------------------------------


def render(doc: Mapping[str, Any], url: str = "", now: float | None = None) -> str:
    """The human table for one status document."""
    now = time.time() if now is None else now
    lines: list[str] = []
    state = "healthy" if doc.get("healthy") is True else "NOT HEALTHY"
    flags = [state, "ready" if doc.get("ready") else "not ready"]
    if doc.get("draining"):
        flags.append("draining")
    if isinstance(doc.get("role"), str):
        flags.append(doc["role"])
    lines.append(f"eventplane  {', '.join(flags)}" + (f"  ({url})" if url else ""))
    problems = doc.get("problems")
    for problem in problems if isinstance(problems, list) else []:
        lines.append(f"problem     {_obj(problem).get('message', problem)}")

    standby = _obj(doc.get("standby"))
    if standby:
        holder = _obj(standby.get("holder"))
        primary = (
            f"primary {standby.get('primary')} pid {holder.get('pid')}, epoch "
            f"{standby.get('epoch')}"
            if standby.get("primary")
            else "no primary holds the archive"
        )
        lines.append(f"standby     {primary}  archive {standby.get('uri')}")
        if standby.get("error"):
            lines.append(f"            {standby['error']}")
        follow = _obj(standby.get("follow"))
        if follow:
            due = standby.get("takeover_in_s")
            lines.append(
                f"            followed to LSN {_int(follow.get('followed_lsn'))}, "
                f"{_int(follow.get('lag_lsns'))} behind ({follow.get('lag_s')} s), "
                f"{_int(follow.get('objects'))} objects here"
                + (f"; takes over in {due} s unless the primary renews" if due is not None else "")
            )
    elif doc.get("took_over"):
        lines.append("standby     took the archive over: this daemon is its primary")
    wal = _obj(doc.get("wal"))
    lines.append(
        f"WAL         head {_int(wal.get('head_lsn'))}  floor {_int(wal.get('retained_floor'))}"
        f"  segments {_int(wal.get('segments'))}"
    )
    archive = _obj(wal.get("archive"))
    if archive:
        state = "FENCED" if archive.get("fenced") else "outage" if archive.get("outage") else "ok"
        lines.append(
            f"archive     {state}  ack {archive.get('ack')}"
            f"  archived {_int(archive.get('archived_lsn'))}"
            f"  unarchived {_int(archive.get('unarchived_bytes'))} B"
            f" / {archive.get('unarchived_age_s')} s  epoch {archive.get('epoch')}"
        )
    lines.append(f"last batch  {_last_batch(doc.get('last_batch'), now)}")
    spark = _obj(doc.get("spark"))
    spark_text = "ready" if spark.get("ready") else "not ready"
    if spark.get("inbox"):
        spark_text += f"  inbox {spark['inbox']}"
    if spark.get("cdc_write"):
        spark_text += f"  cdc write {spark['cdc_write']}"
    if spark.get("last_error"):
        spark_text += f"  last error: {spark['last_error']}"
    lines.append(f"spark       {spark_text}")
    for part in spark.get("missing_parts") or []:
        part = _obj(part)
        lines.append(
            f"missing     {part.get('part')}: {part.get('without')} (`{part.get('fix')}` adds it)"
        )
    dlq, retry = _obj(doc.get("dlq")), _obj(doc.get("retry_queue"))
    lines.append(
        f"triggers    DLQ {_count(dlq.get('entries'))} entries  "
        f"retry queue {_count(retry.get('depth'))}"
    )
    failing = _obj(_obj(doc.get("triggers")).get("failing"))
    for name, error in failing.items():
        lines.append(f"            trigger {name} failing: {error}")
    for name, pause in _obj(_obj(doc.get("triggers")).get("paused")).items():
        p = _obj(pause)
        why = f" ({p['paused_reason']})" if p.get("paused_reason") else ""
        lines.append(
            f"            trigger {name} paused{why} by {p.get('paused_by') or 'unknown'}, "
            f"{_count(p.get('queued_rows'))} rows queued"
        )
    for name, stream in _obj(spark.get("streams")).items():
        compaction = _obj(_obj(stream).get("compaction"))
        if compaction:
            last = _obj(stream).get("last_batch_id")
            lines.append(f"cdc {name:<7} {_compaction(compaction, now, last)}")
        held = _obj(stream).get("quarantined")
        if isinstance(held, int) and held:
            lines.append(
                f"cdc {name:<7} {_count(held)} rows in quarantine "
                f"(eventplane cdc quarantine list {name})"
            )
    for name, mirror in _obj(spark.get("mirrors")).items():
        m = _obj(mirror)
        failed = sum(v for v in _obj(m.get("cast_failures")).values() if isinstance(v, int))
        coalescing = ""
        if isinstance(held_ids := m.get("held_batch_ids"), list) and len(held_ids) == 2:
            coalescing = (
                f"  holding batches {held_ids[0]}-{held_ids[1]} "
                f"({_count(m.get('held_events'))} events) for one merge"
            )
        lines.append(
            f"mirror {name:<4} batch {_int(m.get('last_batch_id'))}  "
            f"{_count(failed)} values that did not fit their column{coalescing}"
        )
        held = m.get("quarantined")
        if isinstance(held, int) and held:
            lines.append(
                f"mirror {name:<4} {_count(held)} events in quarantine "
                f"(eventplane cdc mirror quarantine list {name})"
            )

    stages = doc.get("stages")
    if isinstance(stages, list) and stages:
        lines.append("")
        stage_rows = [_stage_row(_obj(st), now) for st in stages]
        lines.extend(_table(("stage", "batch", "behind", "state"), stage_rows, right=(1, 2)))

    cores = doc.get("cores")
    if isinstance(cores, list) and cores:
        lines.append("")
        header = ("core", "mode", "watermark", "lag", "ring fill", "backpressure", "catch-up")
        rows = [_core_row(_obj(c)) for c in cores]
        lines.extend(_table(header, rows, right=(0, 2, 3, 4)))
    return "\n".join(lines) + "\n"


def summary_line(doc: Mapping[str, Any]) -> str:
    """One line for systemd's ``STATUS=``: modes, lag, WAL head, DLQ.

    ``normal 3, catchup 1 · max lag 1,234 (core 2) · head 99 · batch 17 · dlq 0``
    """
    cores = [_obj(c) for c in doc.get("cores") or []]
    modes: dict[str, int] = {}
    for c in cores:
        mode = str(c.get("mode", "?"))
        modes[mode] = modes.get(mode, 0) + 1
    parts = [", ".join(f"{m} {n}" for m, n in modes.items()) or "no cores"]
    lags: list[tuple[int, Any]] = [
        (c["lag"], c.get("core")) for c in cores if isinstance(c.get("lag"), int)
    ]
    if lags:
        lag, core = max(lags, key=lambda x: x[0])
        parts.append(f"max lag {_count(lag)} (core {core})")
    wal = _obj(doc.get("wal"))
    if "head_lsn" in wal:
        parts.append(f"head {_int(wal['head_lsn'])}")
    batch = _obj(doc.get("last_batch"))
    if "batch_id" in batch:
        parts.append(f"batch {batch['batch_id']}")
    parts.append(f"dlq {_count(_obj(doc.get('dlq')).get('entries'))}")
    if doc.get("draining"):
        parts.insert(0, "draining")
    return " · ".join(parts)


def _core_row(c: Mapping[str, Any]) -> tuple[str, ...]:
    mode = str(c.get("mode", "-"))
    # Tolerant reader: ``ring_fill`` is the contract; a nested ``ring.fill`` is read too.
    fill = c.get("ring_fill", _obj(c.get("ring")).get("fill"))
    return (
        _int(c.get("core")),
        mode,
        _int(c.get("watermark")),
        _count(c.get("lag")),
        _percent(fill),
        str(c.get("backpressure", "-")),
        _catchup(c.get("catchup")),
    )


def _stage_row(st: Mapping[str, Any], now: float) -> tuple[str, ...]:
    return (
        str(st.get("name", "-")),
        _int(st.get("batch_id")),
        _count(st.get("behind_batches")),
        stage_state(st, now),
    )


def stage_state(st: Mapping[str, Any], now: float) -> str:
    """A stage's state in words: ok, catching up, backfilling, failing, STALLED,
    SLOW, STOPPED or paused."""
    behind = st.get("behind_events")
    events = f"{_count(behind)} events behind" if isinstance(behind, int) else ""
    if st.get("stopped"):
        return f"STOPPED on {st.get('stopped_by')} (eventplane resume after the fix): " + str(
            st.get("last_error")
        )
    if st.get("slow"):
        running = st.get("attempt_for_s")
        took = f" {_duration(running)}" if isinstance(running, int | float) else ""
        waits = st.get("waiting_for") or "its attempt"
        return f"SLOW: batch {st.get('attempt_batch_id')} running{took}, waiting for {waits}" + (
            f"; {events}" if events else ""
        )
    if st.get("paused"):
        state = "PAUSED, OVER ITS LIMIT" if st.get("paused_over_limit") else "paused"
        since = _timestamp(st.get("paused_since"))
        if since is not None:
            state += f" for {_duration(max(0.0, now - since))}"
        if st.get("paused_by"):
            state += f" by {st['paused_by']}"
        if st.get("paused_reason"):
            state += f": {st['paused_reason']}"
        return state + (f"; {events}" if events else "")
    if st.get("failing"):
        since = st.get("failing_for_s")
        state = "STALLED" if st.get("stalled") else "failing"
        if isinstance(since, int | float):
            state += f" for {_duration(since)}"
        return state + f", attempt {st.get('attempts', '-')}: {st.get('last_error')}"
    backfill = _obj(st.get("backfill"))
    if st.get("backfilling") and backfill:
        text = (
            f"backfilling from LSN {_int(backfill.get('start_lsn'))}: "
            f"{_count(backfill.get('events_done'))} of {_count(backfill.get('events_total'))} "
            "events"
        )
        rate, eta = backfill.get("rate_per_s"), backfill.get("eta_s")
        if isinstance(rate, int | float) and rate > 0:
            text += f", {_count(int(rate))}/s"
        if isinstance(eta, int | float):
            text += f", about {_duration(eta)} left"
        return text
    if isinstance(st.get("behind_batches"), int) and st["behind_batches"] > 0:
        return "catching up" + (f", {events}" if events else "")
    return "ok"


def _compaction(c: Mapping[str, Any], now: float, last_batch: Any = None) -> str:
    """``files 40 (max 22 per partition, counted 20 s ago)  last #12 3 min ago
    running #13 writing``. The file counts come from the compaction service's
    last scan (every ``compact_interval_s``): its age says how fresh they are,
    "not counted yet" stands for a count before the first scan, and a scan
    older than the stream's last batch says which batch it counted up to."""
    scanned = _timestamp(c.get("scanned_at"))
    counted = "not counted yet" if scanned is None else f"counted {_duration(now - scanned)} ago"
    upto = c.get("scanned_batch_id")
    stale = isinstance(upto, int) and isinstance(last_batch, int) and upto < last_batch
    if scanned is not None and stale:
        counted += f", up to batch #{upto}" if upto else ", before the first batch"
    parts = [
        f"files {_count(c.get('files'))} (max {_count(c.get('max_files_per_partition'))} "
        f"per partition, {counted})"
    ]
    if not c.get("enabled"):
        parts.append("compaction off")
    last = _obj(c.get("last"))
    if last:
        at = _timestamp(last.get("finished_at"))
        ago = f" {_duration(now - at)} ago" if at is not None else ""
        parts.append(f"last compaction #{last.get('id')} {last.get('step')}{ago}")
    running = _obj(c.get("running"))
    if running:
        parts.append(
            f"running #{running.get('id')} {running.get('partition')} {running.get('step')}"
        )
    if c.get("last_error"):
        parts.append(f"failing: {c['last_error']}")
    return "  ".join(parts)


def _catchup(value: Any) -> str:
    cu = _obj(value)
    if not cu:
        return "-"
    text = f"replayed {_count(cu.get('replayed'))}"
    rate = cu.get("rate")
    if isinstance(rate, int | float):
        text += f" at {_count(round(rate))}/s"
    eta = cu.get("eta_s")
    if isinstance(eta, int | float):
        text += f", ETA {_duration(eta)}"
    return text


def _last_batch(value: Any, now: float) -> str:
    b = _obj(value)
    if not b:
        return "none yet"
    text = f"#{b.get('batch_id', '-')}  {_count(b.get('rows'))} rows"
    dur = b.get("duration_s")
    if isinstance(dur, int | float):
        text += f"  {dur:.2f} s"
    at = _timestamp(b.get("committed_at"))
    if at is not None:
        stamp = datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
        text += f"  committed {stamp} ({_duration(max(0.0, now - at))} ago)"
    state = b.get("state")
    if isinstance(state, str) and state != "committed":
        text += f"  {state}"
        if b.get("attempts"):
            text += f" (attempt {b['attempts']})"
    if b.get("error"):
        text += f"  error: {b['error']}"
    return text


def _timestamp(value: Any) -> float | None:
    """committed_at is ISO 8601 (contract); Unix seconds are accepted too."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return parsed.timestamp()
    return None


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(cells).rstrip()

    return [fmt(header), *(fmt(r) for r in rows)]


def _obj(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _int(value: Any) -> str:
    # LSNs stay unformatted: operators paste them into `eventplane wal inspect`.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return "-"


def _count(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "-"


def _percent(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value * 100:.1f}%"
    return "-"


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 120:
        return f"{s} s"
    if s < 2 * 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
