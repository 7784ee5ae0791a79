"""``eventplane check-config``: the file, then every trigger expression with Spark.

1. Load and validate the file (key paths, types, cross-checks): errors exit 2.
   Then the files it names for TLS and tokens: each exists and parses, and
   a secret (a key, the tokens file) is not readable by its group or by
   everyone (``daemon.security.check_secret_files``); problems exit 2 too.
   A stream's table on S3: the bucket reached, conditional writes refused
   the second time (daemon/table/s3.py, ``check``), or exit 2 saying what
   is wrong in one line. The same for ``[wal.archive] uri``.
2. With triggers, and unless ``--no-spark``: start a minimal local Spark
   session (``local[1]``, UI off, log level ERROR) and have it analyse every
   ``when``, emit expression and sql statement against an empty batch, as the
   daemon does at start-up (``TriggerEngine.validate``). Spark's errors exit 2
   too, each naming the trigger and quoting Spark. Progress goes to stderr:
   the JVM takes seconds to start.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from daemon.config import Config

# Runtime SQL settings change how Spark analyses an expression (ANSI casts,
# VARIANT options): the check takes these from [spark.conf]. Cluster, memory
# and JVM settings do not, and a one-thread local session must not use them.
_ANALYSIS_CONF_PREFIX = "spark.sql."


def check_session_conf(conf: Mapping[str, str]) -> dict[str, str]:
    """The user's settings the check's session takes: those that change analysis."""
    return {k: v for k, v in conf.items() if k.startswith(_ANALYSIS_CONF_PREFIX)}


def build_check_session(cfg: Config) -> Any:
    """A minimal local session: one thread, no UI, only errors in its log."""
    from daemon.spark.session import build_session

    return build_session(
        "local[1]",
        f"{cfg.spark.app_name}-check-config",
        ui=False,
        log_level="ERROR",
        conf=check_session_conf(cfg.spark.conf),
    )


def check_triggers(cfg: Config, spark: Any) -> list[str]:
    """Spark's analysis of every trigger of ``cfg``; one message per problem."""
    from triggers.engine import TriggerEngine

    # Nothing is opened: validate() only analyses (the store opens in start()).
    engine = TriggerEngine(cfg.triggers, data_dir=cfg.data_dir)
    return engine.validate(spark)


def main(
    cfg: Config,
    *,
    spark: bool = True,
    out: TextIO | None = None,
    err: TextIO | None = None,
    session_factory: Callable[[Config], Any] = build_check_session,
) -> int:
    """Exit code: 0 OK, 2 a trigger Spark rejects (or a Delta stream that
    Spark writes without Delta's jars, or a table on S3 out of reach), 1 Spark could not start.

    ``out``/``err`` default to ``sys.stdout``/``sys.stderr`` at call time.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    from daemon.security import check_secret_files
    from daemon.spark import deltajars

    problems = check_secret_files(cfg)
    if problems:
        lines = "\n  ".join(problems)
        print(
            f"eventplane: invalid configuration: {cfg.source}: {len(problems)} error(s)\n  {lines}",
            file=err,
        )
        return 2

    from daemon.spark.session import HADOOP_JAR

    needs = deltajars.needing(cfg, HADOOP_JAR.is_file())
    why = deltajars.unavailable(bool(needs), cfg.spark.conf, cfg.spark.remote)
    if why is not None:
        # The daemon runs the other streams; these would fail every batch.
        for name, reason in needs.items():
            print(
                f"eventplane: invalid configuration: {cfg.source}: cdc.streams {name!r} "
                f"needs Delta Lake's jars ({reason}). {why}",
                file=err,
            )
        return 2
    for i, stream in enumerate(cfg.cdc.streams):
        if not stream.uri:
            continue
        from daemon.table import s3

        problem = s3.check(stream.s3 or cfg.s3, stream.uri)
        if problem is not None:
            print(
                f"eventplane: invalid configuration: {cfg.source}: cdc.streams[{i}].path: "
                f"{stream.uri}: {problem}",
                file=err,
            )
            return 2
    archive = cfg.wal.archive
    if archive is not None:
        from daemon.table import s3

        # The archive's objects are create-only and its manifest a lease: the
        # same checks as a table's (docs/wal.md, "The archive").
        problem = s3.check(cfg.s3, archive.uri)
        if problem is not None:
            print(
                f"eventplane: invalid configuration: {cfg.source}: wal.archive.uri: "
                f"{archive.uri}: {problem}",
                file=err,
            )
            return 2
    if spark and cfg.triggers:
        n = len(cfg.triggers)
        print(
            f"checking {n} trigger condition{'s' if n != 1 else ''} with Spark "
            "(--no-spark skips this)...",
            file=err,
            flush=True,
        )
        try:
            session = session_factory(cfg)
        except Exception as exc:
            print(
                f"eventplane: cannot start Spark to check the triggers: "
                f"{type(exc).__name__}: {exc} (--no-spark skips this check)",
                file=err,
            )
            return 1
        try:
            errors = check_triggers(cfg, session)
        finally:
            session.stop()
        if errors:
            lines = "\n  ".join(errors)
            print(
                f"eventplane: invalid configuration: {cfg.source}: "
                f"{len(errors)} error(s)\n  {lines}",
                file=err,
            )
            return 2
    print(f"OK {cfg.source}", file=out)
    return 0
