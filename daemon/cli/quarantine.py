"""``eventplane cdc quarantine list|replay|purge STREAM``: the rows a CDC stream
set aside because it could not write them (docs/cdc.md, "Quarantine").

``list`` reads the quarantine's files (it works while the daemon runs).
``replay`` writes rows back into the table once the cause is fixed, exactly
once; rows the writer still refuses stay. ``purge`` removes rows for good,
after recording them (who, when, the rows) in ``quarantine/purged.jsonl``.
Both go through the daemon's admin API while it holds the stream, and
otherwise take the stream's lock and do it here (``replay`` with an embedded
``local[1]`` Spark).

``eventplane cdc mirror quarantine list|replay|purge NAME``: the same verbs on
a strict mirror's events that did not fit its columns (docs/cdc.md, "Mirror
tables"); a replay merges them with delta-rs (``MirrorTable.replay_quarantine``),
no Spark. Both kinds share :class:`Target` and everything but the replay.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from daemon.config import CdcMirror, CdcStream, Config
from daemon.errors import IdentityMismatchError
from daemon.table import quarantine
from daemon.table.delta import sink_class
from daemon.table.errors import CdcLayoutError, CdcStreamLockedError
from daemon.table.layout import META_DIR
from daemon.table.ledger import read_ledger
from daemon.table.parquet import CdcSink

MAX_ERROR_CHARS = 100  # per row in the table view; --json has it whole


@dataclass(frozen=True, slots=True)
class Target:
    """Whose quarantine: a stream's or a mirror's."""

    kind: str  # "stream" or "mirror"
    name: str
    meta: Path  # <path>/_eventplane
    command: str  # the verb's prefix, in messages

    @property
    def url_path(self) -> str:
        """Under the admin base URL: the replay and purge endpoints' prefix."""
        where = self.name if self.kind == "stream" else f"mirror/{self.name}"
        return f"/v1/cdc/{where}/quarantine"

    @property
    def shown(self) -> str:
        return f"{self.kind} {self.name!r}"


def stream_target(stream: CdcStream) -> Target:
    return Target("stream", stream.name, Path(stream.path) / META_DIR, "eventplane cdc quarantine")


def mirror_target(mirror: CdcMirror) -> Target:
    return Target(
        "mirror", mirror.name, Path(mirror.path) / META_DIR, "eventplane cdc mirror quarantine"
    )


def main(args: argparse.Namespace, cfg: Config, out: TextIO, *, session: Any = None) -> int:
    stream = next((s for s in cfg.cdc.streams if s.name == args.stream), None)
    if stream is None:
        known = ", ".join(s.name for s in cfg.cdc.streams) or "none configured"
        _err(f"no stream named {args.stream!r} (streams: {known})")
        return 1
    target = stream_target(stream)
    lsns, early = _checked(args, target, out)
    if early is not None:
        return early
    return _act(args, cfg, stream, lsns, out, session)


def mirror_main(args: argparse.Namespace, cfg: Config, mirror: CdcMirror, out: TextIO) -> int:
    """``eventplane cdc mirror quarantine``: the mirror is open here, or the
    daemon that holds it does the replay or purge (admin API)."""
    from daemon.table.mirror import MirrorTable, table_wal_id

    target = mirror_target(mirror)
    lsns, early = _checked(args, target, out)
    if early is not None:
        return early
    action = args.quarantine_command
    wal_id = table_wal_id(mirror)
    if wal_id is None:
        _err(f"mirror {mirror.name!r}: {mirror.location} holds no table yet", target)
        return 1
    table = MirrorTable(mirror, wal_id=wal_id, cores=cfg.daemon.cores)
    try:
        table.open()
    except CdcStreamLockedError:
        return _through_daemon(args, cfg, target, lsns, out)
    except (CdcLayoutError, IdentityMismatchError) as exc:
        _err(str(exc), target)
        return 1
    try:
        if action == "purge":
            result: dict[str, Any] = {
                "mirror": mirror.name,
                "purged": table.purge_quarantine(lsns, quarantine.who()),
            }
        else:
            result = table.replay_quarantine(lsns)
        result["quarantined"] = table.quarantined
    finally:
        table.close()
    _report(action, result, out, target)
    return 0


def _checked(
    args: argparse.Namespace, target: Target, out: TextIO
) -> tuple[set[int] | None, int | None]:
    """``list`` done, or a purge refused (its exit code); else the LSNs asked for."""
    if args.quarantine_command == "list":
        return None, list_rows(target, as_json=args.json, out=out)
    lsns = set(args.lsn) if args.lsn else None
    if args.quarantine_command == "purge":
        if lsns is None and not args.all:
            _err("purge needs --lsn N (repeatable) or --all", target)
            return None, 2
        if not args.yes and not _confirm(target, lsns):
            _err(
                "purge not confirmed: nothing was removed (pass --yes to skip the question)",
                target,
            )
            return None, 1
    return lsns, None


def list_rows(target: Target, *, as_json: bool, out: TextIO) -> int:
    rows = [r.shown() for r in quarantine.load(target.meta)]
    if target.kind == "mirror":  # which a replay does not write (a newer event of the key)
        from daemon.table.mirror import superseded_marks

        marks = superseded_marks(target.meta)
        for r in rows:
            r["superseded_by"] = marks.get(r["lsn"])
    if as_json:
        print(json.dumps(rows), file=out)
        return 0
    if not rows:
        print(f"{target.shown}: the quarantine is empty", file=out)
        return 0
    print(f"{target.shown}: {len(rows)} row(s) in the quarantine", file=out)
    print("lsn\tbatch\tcollection\tkey\terror", file=out)
    for r in rows:
        error = r["error"]
        if len(error) > MAX_ERROR_CHARS:
            error = error[: MAX_ERROR_CHARS - 3] + "..."
        if r.get("superseded_by") is not None:
            error += f" (superseded by LSN {r['superseded_by']})"
        print(f"{r['lsn']}\t{r['batch_id']}\t{r['collection']}\t{r['key']}\t{error}", file=out)
    return 0


def _act(
    args: argparse.Namespace,
    cfg: Config,
    stream: CdcStream,
    lsns: set[int] | None,
    out: TextIO,
    session: Any,
) -> int:
    action = args.quarantine_command
    ledger = read_ledger(stream.path)
    if ledger is None:
        _err(f"stream {stream.name!r}: {stream.path} holds no table yet")
        return 1
    sink = sink_class(stream)(
        stream,
        wal_id=ledger.wal_id,
        cores=ledger.cores,
        data_dir=cfg.data_dir,
        daemon_name=cfg.daemon.name,
    )
    try:
        sink.open()
    except CdcStreamLockedError:
        return _through_daemon(args, cfg, stream_target(stream), lsns, out)
    try:
        if action == "purge":
            result: dict[str, Any] = {
                "stream": stream.name,
                "purged": sink.purge_quarantine(lsns, quarantine.who()),
            }
        else:
            result = _replay_here(sink, lsns, session)
        result["quarantined"] = sink.quarantined
    finally:
        sink.close()
    _report(action, result, out, stream_target(stream))
    return 0


def _replay_here(sink: CdcSink, lsns: set[int] | None, session: Any) -> dict[str, Any]:
    from daemon.spark import frame

    owned = session is None
    if owned:
        from daemon.spark.session import build_session

        session = build_session("local[1]", "eventplane-cdc-quarantine", False, "ERROR", {})
    try:
        return sink.replay_quarantine(
            session, lambda batch: frame.batch_frame(session, batch, None, 1)[0], lsns
        )
    finally:
        if owned:
            session.stop()


def _through_daemon(
    args: argparse.Namespace,
    cfg: Config,
    target: Target,
    lsns: set[int] | None,
    out: TextIO,
) -> int:
    """The daemon holds the stream or mirror: it replays or purges (admin API)."""
    from daemon.cli import access
    from daemon.cli.compact import Unreachable, _call
    from daemon.cli.status import STATUS_PATH, admin_url

    action = args.quarantine_command
    base = admin_url(cfg, getattr(args, "url", None)).removesuffix(STATUS_PATH)
    url = f"{base}{target.url_path}/{action}"
    body = {"lsns": sorted(lsns) if lsns is not None else None, "by": quarantine.who()}
    try:
        admin = access.from_args(args, access.ENV_ADMIN_TOKEN_FILE)
        status, doc = _call("POST", url, timeout=600.0, body=body, access=admin)
    except Unreachable as exc:
        _err(f"{target.shown} is locked and no daemon answers at {url} ({exc})", target)
        return 1
    if status != 200:
        _err(f"the daemon answered {status}: {doc.get('message', doc)}", target)
        return 1
    _report(action, doc, out, target)
    return 0


def _report(action: str, result: dict[str, Any], out: TextIO, target: Target) -> None:
    if action == "purge":
        print(
            f"purged {result['purged']} row(s) of {target.shown} (recorded in "
            f"{META_DIR}/quarantine/{quarantine.PURGE_LOG}); {result['quarantined']} left",
            file=out,
        )
        return
    superseded = result.get("superseded")
    newer = (
        f"{len(superseded)} superseded by a newer event of their key (not written); "
        if superseded
        else ""
    )
    print(
        f"replayed {result['replayed']} row(s) of {target.shown} into the table; "
        f"{newer}{result['quarantined']} left in the quarantine",
        file=out,
    )
    for r in result.get("still_refused", []):
        print(f"  still refused: LSN {r['lsn']}: {r['error']}", file=out)


def _confirm(target: Target, lsns: set[int] | None) -> bool:
    if not sys.stdin.isatty():
        return False
    what = "every row" if lsns is None else f"{len(lsns)} row(s)"
    answer = input(f"remove {what} of {target.shown}'s quarantine for good? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _err(message: str, target: Target | None = None) -> None:
    command = target.command if target is not None else "eventplane cdc quarantine"
    print(f"{command}: {message}", file=sys.stderr)
