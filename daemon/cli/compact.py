"""``eventplane cdc compact STREAM [--dry-run] [--url URL]``: merge a stream's small files now.

When the daemon runs, it is asked through its admin API (``POST
/v1/cdc/<stream>/compact``) and the command prints the compactions' progress
(``GET /v1/cdc/<stream>/compaction``) until they are done: the daemon holds
the stream's lock, and its compaction service runs them beside the batches.
When no daemon answers, the command takes the stream's lock itself (so a
daemon cannot start writing meanwhile), runs the stream's recovery, and
compacts with an embedded Spark session (``local`` master, ``[spark.conf]``
of the config, so the merged files are written like the daemon's).

A manual compaction is *full*: every file below half of ``target_file_bytes``
is merged (the background one goes by size tiers; docs/cdc.md, "Compaction").
``--dry-run`` prints what would be merged and changes nothing.

Exit codes: 0 done (or nothing to do), 1 failed or unknown stream, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, TextIO

from daemon.cli.access import NO_ACCESS, Access
from daemon.cli.status import STATUS_PATH, admin_url
from daemon.config import CdcStream, Config

POLL_S = 0.3


class Unreachable(Exception):
    """No daemon answers on the admin address."""


def _call(
    method: str,
    url: str,
    timeout: float = 10.0,
    body: dict[str, Any] | None = None,
    access: Access = NO_ACCESS,
) -> tuple[int, dict[str, Any]]:
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with access.urlopen(request, timeout) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {"message": f"HTTP {exc.code}"}
        finally:
            exc.close()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise Unreachable(str(getattr(exc, "reason", exc))) from exc


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def describe_plan(p: dict[str, Any]) -> str:
    return (
        f"{p['partition']}: {p['inputs']} of {p['files_before']} files "
        f"({_size(p['input_bytes'])}) -> {p['outputs']} file(s), batches "
        f"{p['first_batch']}-{p['last_batch']}; {p['files_after']} files after"
    )


def describe_progress(p: dict[str, Any]) -> str:
    text = (
        f"compaction #{p['id']} {p['partition']}: {p['step']}, {p['inputs']} files "
        f"({_size(p['input_bytes'])})"
    )
    if p["step"] == "done":
        text += (
            f" -> {p['outputs']} file(s) ({_size(p['output_bytes'])}), {p['rows']:,} rows, "
            f"{p['seconds']} s"
        )
    if p.get("error"):
        text += f": {p['error']}"
    return text


def _print_plans(stream: CdcStream, plans: list[dict[str, Any]], out: TextIO) -> None:
    if not plans:
        print(f"stream {stream.name!r} ({stream.path}): nothing to compact", file=out)
        return
    print(f"stream {stream.name!r} ({stream.path}): would compact", file=out)
    for p in plans:
        print("  " + describe_plan(p), file=out)


def _files_line(status: dict[str, Any]) -> str:
    per = status.get("files_per_partition") or {}
    shown = ", ".join(f"{k} {v}" for k, v in sorted(per.items()))
    return f"data files now: {status.get('files', 0)} ({shown or 'no partitions'})"


def via_daemon(
    base: str,
    stream: CdcStream,
    dry_run: bool,
    timeout: float,
    out: TextIO,
    access: Access = NO_ACCESS,
) -> int:
    """Ask a running daemon; raises Unreachable when none answers."""
    url = f"{base}/v1/cdc/{urllib.parse.quote(stream.name, safe='')}"
    code, doc = _call("POST", f"{url}/compact" + ("?dry_run=1" if dry_run else ""), access=access)
    if code >= 400:
        print(f"eventplane cdc compact: the daemon says: {doc.get('message')}", file=sys.stderr)
        return 1
    if dry_run:
        _print_plans(stream, list(doc.get("plans") or []), out)
        return 0
    request = int(doc["request"])
    print(f"stream {stream.name!r}: compaction requested from the daemon at {base}", file=out)
    seen: set[tuple[Any, Any]] = set()
    deadline = time.monotonic() + timeout
    while True:
        code, status = _call("GET", f"{url}/compaction", access=access)
        if code >= 400:
            print(f"eventplane cdc compact: {status.get('message')}", file=sys.stderr)
            return 1
        for p in (status.get("last"), status.get("running")):
            if p and p.get("request") == request and (p["id"], p["step"]) not in seen:
                seen.add((p["id"], p["step"]))
                print("  " + describe_progress(p), file=out)
        if int(status.get("requests_done") or 0) >= request:
            break
        if time.monotonic() > deadline:
            print(
                f"eventplane cdc compact: not done after {timeout:g} s; it goes on in "
                f"the daemon (eventplane status shows it)",
                file=sys.stderr,
            )
            return 1
        time.sleep(POLL_S)
    last = status.get("last") or {}
    if status.get("failures_in_a_row") and last.get("request") == request:
        print(f"eventplane cdc compact: failed: {status.get('last_error')}", file=sys.stderr)
        return 1
    if not any(step == "done" for _, step in seen):
        print("  nothing to compact", file=out)
    print(_files_line(status), file=out)
    return 0


def locally(
    cfg: Config, stream: CdcStream, dry_run: bool, session: Any, out: TextIO, base: str
) -> int:
    """No daemon answered: lock the stream and compact with our own Spark."""
    from daemon.table import compact, compactplan
    from daemon.table.delta import sink_class
    from daemon.table.errors import CdcStreamLockedError
    from daemon.table.ledger import read_ledger

    if read_ledger(stream.path) is None:
        print(f"stream {stream.name!r} ({stream.path}): no committed rows yet", file=out)
        return 0
    sink = sink_class(stream)(
        stream, wal_id="", cores=cfg.daemon.cores, daemon_name=cfg.daemon.name
    )
    try:
        sink.open()  # the stream's lock, and its recovery
    except CdcStreamLockedError as exc:
        print(
            f"eventplane cdc compact: no daemon answered at {base}, but {exc}. "
            f"Point --url at that daemon's admin listener.",
            file=sys.stderr,
        )
        return 1
    owned = False
    try:
        if dry_run:
            _print_plans(
                stream, [p.to_json() for p in compactplan.plan_stream(sink, full=True)], out
            )
            return 0
        if not compactplan.plan_stream(sink, full=True):
            print(f"stream {stream.name!r} ({stream.path}): nothing to compact", file=out)
            return 0
        if session is None:
            from daemon.spark.session import build_session

            master = cfg.spark.master if cfg.spark.master.startswith("local") else "local[*]"
            conf = {k: v for k, v in cfg.spark.conf.items() if k != "spark.master"}
            session = build_session(
                master,
                "eventplane-cdc-compact",
                False,
                "ERROR",
                conf,
                delta=stream.format == "delta",
            )
            owned = True
        print(f"stream {stream.name!r}: no daemon at {base}; compacting here", file=out)

        def started(p: compactplan.Progress) -> None:
            j = p.to_json()
            print(
                f"  compacting {j['partition']}: {j['inputs']} files "
                f"({_size(j['input_bytes'])}) -> {j['outputs']} file(s), "
                f"batches {j['first_batch']}-{j['last_batch']}",
                file=out,
            )

        try:
            done = compact.compact_stream(sink, session, full=True, on_progress=started)
        except Exception as exc:
            print(f"eventplane cdc compact: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        for p in done:
            print("  " + describe_progress(p.to_json()), file=out)
        counts = compactplan.file_counts(sink)
        print(_files_line({"files": sum(counts.values()), "files_per_partition": counts}), file=out)
        return 0
    finally:
        sink.close()
        if owned:
            session.stop()


def main(
    args: argparse.Namespace,
    cfg: Config,
    *,
    session: Any = None,
    out: TextIO | None = None,
    access: Access = NO_ACCESS,
) -> int:
    out = out or sys.stdout
    stream = next((s for s in cfg.cdc.streams if s.name == args.stream), None)
    if stream is None:
        known = ", ".join(s.name for s in cfg.cdc.streams) or "none configured"
        print(
            f"eventplane cdc compact: no stream named {args.stream!r} (streams: {known})",
            file=sys.stderr,
        )
        return 1
    base = admin_url(cfg, args.url).removesuffix(STATUS_PATH)
    try:
        return via_daemon(base, stream, args.dry_run, args.timeout, out, access)
    except Unreachable:
        return locally(cfg, stream, args.dry_run, session, out, base)
