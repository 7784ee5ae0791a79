"""The ``eventplane`` command (a contract: README and docs/operating.md).

Each subcommand imports its implementation lazily, so ``eventplane
check-config`` answers in milliseconds without loading Spark or aiohttp.
Exit codes: 0 success, 1 failure the command reports, 2 usage or config error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from daemon import config as configmod
from daemon.cli import access
from daemon.errors import ConfigError


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"config file (default: ${configmod.ENV_CONFIG} or ./config.toml)",
    )


def _add_admin_access(p: argparse.ArgumentParser) -> None:
    access.add_arguments(p, access.ENV_ADMIN_TOKEN_FILE, "admin")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eventplane",
        description="Durable change-event plane: WAL, per-core consumers, Spark triggers, CDC.",
    )
    parser.add_argument("--version", action="version", version=f"eventplane {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the daemon in the foreground")
    _add_config(p)

    p = sub.add_parser(
        "check-config",
        help="validate the config (triggers with Spark); print OK or every error",
    )
    _add_config(p)
    p.add_argument(
        "--no-spark",
        action="store_true",
        help="skip the Spark analysis of trigger expressions (it starts a JVM: seconds)",
    )

    p = sub.add_parser(
        "setup",
        help="build the daemon's jar and fetch Delta Lake's jars where they are missing",
    )
    _add_config(p)
    p.add_argument(
        "--delta", action="store_true", help="fetch Delta Lake's jars even if no stream needs them"
    )

    p = sub.add_parser("status", help="print the daemon's status; non-zero when unhealthy")
    _add_config(p)
    p.add_argument("--url", help="admin base URL (default: from config admin.listen)")
    p.add_argument("--json", action="store_true", help="print the raw /v1/status JSON")
    _add_admin_access(p)

    p = sub.add_parser(
        "pause",
        help="pause a stage (cdc:<stream>, triggers, handler:<ref>) or one trigger "
        "(trigger:<name>) of the running daemon",
    )
    _add_config(p)
    p.add_argument("stage", help="the stage, as `eventplane status` names it (e.g. cdc:all)")
    p.add_argument("--reason", help="why, shown in status and kept with the pause")
    p.add_argument("--url", help="admin base URL (default: from config admin.listen)")
    _add_admin_access(p)

    p = sub.add_parser("resume", help="resume a paused stage; it catches up on what it missed")
    _add_config(p)
    p.add_argument("stage", help="the stage, as `eventplane status` names it (e.g. cdc:all)")
    p.add_argument("--url", help="admin base URL (default: from config admin.listen)")
    _add_admin_access(p)

    p = sub.add_parser("send", help="post NDJSON events from stdin to the ingest API")
    _add_config(p)
    p.add_argument(
        "--url",
        action="append",
        help="ingest base URL (default: from config ingest.listen); repeat it for a primary "
        "and its standby: each request fails over in order, with the same Idempotency-Key",
    )
    p.add_argument(
        "--route",
        choices=("order", "key"),
        default="order",
        help="order: every request to the first --url that takes it (failover, the default); "
        "key: each event to the --url its collection and key pick, always the same one",
    )
    p.add_argument("--batch", type=int, default=1000, help="events per request (default 1000)")
    p.add_argument(
        "--retry-for",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="retry a request (same Idempotency-Key) for up to this long; 0: never (default 120)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="longest wait for the daemon in one attempt (default 30)",
    )
    p.add_argument(
        "--key-prefix",
        metavar="PREFIX",
        help="Idempotency-Keys are PREFIX:<first stdin line of the request> (default random)",
    )
    p.add_argument(
        "--from-line",
        type=int,
        default=1,
        metavar="N",
        help="skip stdin lines before N (a resend with the same --key-prefix)",
    )
    access.add_arguments(p, access.ENV_TOKEN_FILE, "producer")

    p = sub.add_parser(
        "restore",
        help="rebuild an empty data_dir from the WAL archive ([wal.archive]), same WAL id",
    )
    _add_config(p)
    p.add_argument(
        "--accept-loss-from",
        type=int,
        default=None,
        metavar="LSN",
        help="a gap or a bad object at LSN: restore what is before it (the LSNs lost are named)",
    )

    p = sub.add_parser("wal", help="inspect, verify or repair the write-ahead log")
    wal_sub = p.add_subparsers(dest="wal_command", required=True, metavar="ACTION")
    for name, text in (
        ("inspect", "print segments, LSN ranges and per-core counts"),
        ("verify", "check every frame of every segment"),
        ("repair", "truncate at the first bad frame (asks first)"),
    ):
        q = wal_sub.add_parser(name, help=text)
        _add_config(q)
        q.add_argument("--dir", type=Path, help="WAL directory (default: <data_dir>/wal)")
        if name == "repair":
            q.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    p = sub.add_parser("dlq", help="list, replay or purge dead-lettered trigger actions")
    dlq_sub = p.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    q = dlq_sub.add_parser("list", help="list DLQ entries")
    _add_config(q)
    q.add_argument("--trigger", help="only this trigger's entries")
    q.add_argument("--limit", type=int, default=100)
    q = dlq_sub.add_parser("replay", help="move entries back to the retry queue")
    _add_config(q)
    group = q.add_mutually_exclusive_group(required=True)
    group.add_argument("--id", type=int, dest="entry_id")
    group.add_argument("--trigger")
    q = dlq_sub.add_parser("purge", help="delete DLQ entries")
    _add_config(q)
    q.add_argument("--trigger", help="only this trigger's entries")

    p = sub.add_parser("cdc", help="look at and compact CDC tables")
    cdc_sub = p.add_subparsers(dest="cdc_command", required=True, metavar="ACTION")
    q = cdc_sub.add_parser("show", help="print the latest rows of a CDC stream")
    _add_config(q)
    q.add_argument("stream")
    q.add_argument("--limit", type=int, default=20)
    q = cdc_sub.add_parser(
        "files",
        help="print a consistent list of a CDC stream's data files (for exact reads)",
        description="A snapshot of the stream's data files, taken through the table's "
        "generation so that no compaction or retention removal cut through it "
        "(docs/cdc.md, 'Reading while compaction runs'). One absolute path per line, or "
        "JSON with --json. Read-only: works while the daemon runs.",
    )
    _add_config(q)
    q.add_argument("stream")
    q.add_argument("--json", action="store_true", help="print {root, generation, files} as JSON")
    q = cdc_sub.add_parser(
        "lease",
        help="show (or --break) the writer's lease of a CDC table on S3",
        description="A table on S3 has one writer, the daemon holding its lease "
        "(_eventplane/lease.json under the table's prefix; docs/cdc.md, 'Tables on S3'). "
        "After a daemon was killed, the next one takes the lease once it expires "
        "([s3] lease_ttl_s + lease_skew_s, 35 s by default); --break removes it at once.",
    )
    _add_config(q)
    q.add_argument("stream")
    q.add_argument("--break", dest="break_lease", action="store_true", help="remove the lease")
    q.add_argument("--yes", action="store_true", help="do not ask for a confirmation")
    q = cdc_sub.add_parser(
        "rewrite",
        help="rewrite a stream's files of the previous payload layout (daemon stopped)",
        description="Rewrite the files a daemon before 2026-11-25 wrote (shredded VARIANT, "
        "no new_json/old_json) into the current layout, in place, so pyarrow, pandas and "
        "Polars read the whole table (docs/cdc.md). Takes the stream's lock: stop the "
        "daemon first.",
    )
    _add_config(q)
    q.add_argument("stream")
    q = cdc_sub.add_parser(
        "quarantine",
        help="list, replay or purge the rows a CDC stream set aside (docs/cdc.md, 'Quarantine')",
    )
    _add_quarantine(q, "stream")
    q = cdc_sub.add_parser(
        "retention", help="preview (or --apply) removing a CDC stream's expired partitions"
    )
    _add_config(q)
    q.add_argument("stream")
    q.add_argument(
        "--apply", action="store_true", help="remove them (through the daemon when it runs)"
    )
    q.add_argument("--url", help="admin base URL (default: from config admin.listen)")
    _add_admin_access(q)
    q = cdc_sub.add_parser(
        "mirror", help="check, rebuild or look at the quarantine of a mirror table"
    )
    m_sub = q.add_subparsers(dest="mirror_command", required=True, metavar="ACTION")
    r = m_sub.add_parser(
        "verify",
        help="compare a mirror with a fold of its change log; exit 1 if they differ",
        description="Fold the change log (a Delta CDC stream that takes the mirror's "
        "collection) up to the mirror's last batch and compare it with the mirror, row by "
        "row and column by column (docs/cdc.md, 'Mirror tables'). Prints the first "
        "differences and exits 1, or a one-line summary and exits 0; 2 when there is no "
        "log to compare with. Read-only: works while the daemon runs.",
    )
    _add_config(r)
    r.add_argument("mirror")
    r.add_argument("--limit", type=int, default=10, help="differences shown (10)")
    r = m_sub.add_parser(
        "rebuild",
        help="fold a mirror anew from its change log into a new table, then switch to it",
        description="Fold the change log (a Delta CDC stream that takes the mirror's "
        "collection) into a new table as the config says (buckets, columns, history), "
        "then swap it for the old one in one step (docs/cdc.md, 'Mirror tables'). Takes "
        "the mirror's lock: stop the daemon first. Killed, it leaves the old mirror in "
        "place; run it again.",
    )
    _add_config(r)
    r.add_argument("mirror")
    r = m_sub.add_parser(
        "quarantine",
        help="list, replay or purge the events a strict mirror set aside (docs/cdc.md, "
        "'Mirror tables')",
    )
    _add_quarantine(r, "mirror")
    q = cdc_sub.add_parser(
        "compact",
        help="merge a CDC stream's small files now (through the daemon when it runs)",
    )
    _add_config(q)
    q.add_argument("stream")
    q.add_argument("--dry-run", action="store_true", help="print what would be merged")
    q.add_argument("--url", help="admin base URL (default: from config admin.listen)")
    q.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds to wait for the daemon (3600)"
    )
    _add_admin_access(q)
    return parser


def _add_quarantine(q: argparse.ArgumentParser, owner: str) -> None:
    """``list``, ``replay`` and ``purge`` of a ``stream``'s or a ``mirror``'s quarantine."""
    q_sub = q.add_subparsers(dest="quarantine_command", required=True, metavar="ACTION")
    r = q_sub.add_parser("list", help=f"the rows in the {owner}'s quarantine, with their errors")
    _add_config(r)
    r.add_argument(owner)
    r.add_argument("--json", action="store_true", help="a JSON array of rows")
    into = "the table" if owner == "stream" else "the mirror"
    for name, text in (
        ("replay", f"write quarantined rows into {into} once the cause is fixed"),
        ("purge", "remove quarantined rows for good (recorded in quarantine/purged.jsonl)"),
    ):
        r = q_sub.add_parser(name, help=text)
        _add_config(r)
        r.add_argument(owner)
        r.add_argument(
            "--lsn", type=int, action="append", help="only this row (repeatable; default: all)"
        )
        r.add_argument("--url", help="admin base URL (default: from config admin.listen)")
        _add_admin_access(r)
        if name == "purge":
            r.add_argument("--all", action="store_true", help="every row of the quarantine")
            r.add_argument("--yes", action="store_true", help="do not ask for a confirmation")


def _load(args: argparse.Namespace) -> configmod.Config:
    return configmod.load(args.config)


def _load_for_client(args: argparse.Namespace) -> configmod.Config:
    """Config for a command that talks to a daemon: with ``--url`` and no config
    file at the default place, the defaults do (nothing else is read from it)."""
    if args.url and args.config is None and not configmod.default_path().exists():
        return configmod.parse({})
    return _load(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eventplane")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(f"eventplane: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except access.AccessError as exc:
        print(f"eventplane {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`eventplane status --json | head`): stop quietly.
        # Point stdout at /dev/null so the interpreter's final flush cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _run(args: argparse.Namespace) -> int:
    """``eventplane run``: an invalid file is one ``startup.failed`` event, in the
    log format the file asks for when that much of it can be read, and exit 2."""
    from daemon.service import app, logs

    try:
        cfg = _load(args)
    except ConfigError as exc:
        logs.configure("info", _log_format_of(args.config))
        app.log_startup_failure("the configuration", exc, app.EXIT_CONFIG)
        return app.EXIT_CONFIG
    return app.run(cfg)


def _log_format_of(path: Path | None) -> str:
    """``[log] format`` of a config file that failed validation, else ``auto``."""
    import tomllib

    try:
        raw = tomllib.loads((path or configmod.default_path()).read_text(encoding="utf-8"))
        fmt = raw["log"]["format"]
    except (OSError, ValueError, KeyError, TypeError):
        return "auto"
    return fmt if fmt in ("auto", "json", "console") else "auto"


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "check-config":
        from daemon.cli import checkconfig

        return checkconfig.main(_load(args), spark=not args.no_spark)
    if args.command == "run":
        return _run(args)
    if args.command == "setup":
        from daemon.cli import setup

        return setup.main(_load(args), delta=args.delta)
    if args.command == "status":
        from daemon.cli import status

        admin = access.from_args(args, access.ENV_ADMIN_TOKEN_FILE)
        return status.main(args, _load_for_client(args), access=admin)
    if args.command in ("pause", "resume"):
        from daemon.cli import stages

        admin = access.from_args(args, access.ENV_ADMIN_TOKEN_FILE)
        return stages.main(args, _load_for_client(args), access=admin)
    if args.command == "send":
        from daemon.cli import send

        return send.main(args, _load_for_client(args))
    if args.command == "restore":
        from daemon import restore

        return restore.main(_load(args), args.accept_loss_from)
    if args.command == "wal":
        from wal import tool

        directory: Path = args.dir if args.dir is not None else _load(args).wal_dir
        if args.wal_command == "inspect":
            return tool.inspect(directory, sys.stdout)
        if args.wal_command == "verify":
            return tool.verify(directory, sys.stdout, progress=sys.stderr.isatty())
        return tool.repair(directory, sys.stdout, assume_yes=args.yes)
    if args.command == "dlq":
        from daemon.cli import dlq

        return dlq.main(args, _load(args))
    if args.command == "cdc":
        from daemon.cli import cdc

        return cdc.main(args, _load(args))
    raise AssertionError(f"unhandled command {args.command}")  # argparse forbids this


if __name__ == "__main__":
    sys.exit(main())
