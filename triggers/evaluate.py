"""The Spark side of triggers: analysis of specs, evaluation of a batch, sql actions.

Everything here runs in the Spark worker thread (py4j blocks). One batch costs
one Spark job for all triggers together: each trigger's condition becomes a
boolean column, the rows matching any of them are rendered to JSON once and
collected through Arrow. Only ``sql`` actions add a job each (their statement).

A trigger's condition is::

    CASE WHEN collection = <collection> AND op IN (<on>) [AND depth = 0]
         THEN coalesce(<when>, false) ELSE false END

``CASE`` keeps Spark from evaluating ``when`` on rows of other collections, so
``new:amount::double`` cannot fail on an unrelated event's ``amount``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec

from triggers import rows as rowsmod
from triggers.errors import TriggerEvaluationError
from triggers.spec import BATCH_COLUMNS, BATCH_SCHEMA_DDL, EmitAction, SqlAction, Trigger

# to_json of the batch columns: nulls kept (``"old": null``), timestamps in UTC
# with microseconds, the precision Spark keeps.
_DOC_OPTIONS = {
    "ignoreNullFields": "false",
    "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
    "timeZone": "UTC",
}
MATCHED_VIEW = "matched"
_MESSAGE_MAX = 600


def spark_message(exc: BaseException) -> str:
    """Spark's own message, first line (error class, text, SQLSTATE, position)."""
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return line if len(line) <= _MESSAGE_MAX else line[: _MESSAGE_MAX - 3] + "..."


def _functions() -> Any:
    from pyspark.sql import functions as F  # pyspark loads lazily

    return F


def condition(t: Trigger) -> Any:
    """The trigger's boolean Column over the batch DataFrame."""
    F = _functions()
    gate = (F.col("collection") == F.lit(t.collection)) & F.col("op").isin(list(t.on))
    if not t.fire_on_derived:
        gate = gate & (F.col("depth") == F.lit(0))
    return F.when(gate, F.coalesce(F.expr(t.when), F.lit(False))).otherwise(F.lit(False))


def _doc_column() -> Any:
    F = _functions()
    return F.to_json(F.struct(*[F.col(c) for c in BATCH_COLUMNS]), _DOC_OPTIONS)


def _emit_value(what: str, expression: str) -> Any:
    """An emit action's key (as a string) or new (as JSON text) column."""
    F = _functions()
    if what == "key":
        return F.expr(expression).cast("string")
    return F.to_json(F.expr(expression))


def _emit_columns(t: Trigger, cond: Any, i: int) -> list[Any]:
    F = _functions()
    action = t.action
    out: list[Any] = []
    if isinstance(action, EmitAction):
        if action.key is not None:
            out.append(F.when(cond, _emit_value("key", action.key)).alias(f"k{i}"))
        if action.new is not None:
            out.append(F.when(cond, _emit_value("new", action.new)).alias(f"n{i}"))
    return out


def empty_batch(spark: Any) -> Any:
    return spark.createDataFrame([], BATCH_SCHEMA_DDL)


# --------------------------------------------------------------------------
# Analysis (startup and reload)

_EXPLAIN_ERROR = re.compile(r"(?:^|\s)[\w.$]*(?:Exception|Error): (.+)$")


def _explain_error(plan: str) -> str | None:
    """EXPLAIN EXTENDED reports analysis errors inside the plan text, not as exceptions."""
    for line in plan.splitlines():
        match = _EXPLAIN_ERROR.search(line)
        if match:
            return match.group(1).strip()
    if plan.startswith("Error occurred during query planning"):
        return plan.strip()
    return None


# PySpark logs every analysis error it raises, with the JVM stack trace, on
# these loggers. While validating user expressions we report each error
# ourselves (one line, trigger named), so the duplicates are muted.
_PYSPARK_ERROR_LOGGERS = ("SQLQueryContextLogger", "DataFrameQueryContextLogger")


@contextlib.contextmanager
def _quiet_pyspark_errors() -> Iterator[None]:
    # Through PySparkLogger: a plain logging.getLogger would create the logger
    # with the wrong class, and PySpark's own calls (extra keyword arguments)
    # would then fail.
    from pyspark.logger import PySparkLogger

    loggers = [PySparkLogger.getLogger(name) for name in _PYSPARK_ERROR_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def analyze(
    triggers: Sequence[Trigger], spark: Any, sql_lock: threading.Lock | None = None
) -> list[str]:
    """Have Spark analyze each trigger against the batch schema; one error per problem.

    Nothing runs: filters and selects over an empty DataFrame are only
    analyzed, and a sql action's statement goes through ``EXPLAIN EXTENDED``.
    """
    with _quiet_pyspark_errors():
        return _analyze(triggers, spark, sql_lock or threading.Lock())


def _analyze(triggers: Sequence[Trigger], spark: Any, sql_lock: threading.Lock) -> list[str]:
    F = _functions()
    empty = empty_batch(spark)
    errors: list[str] = []
    for t in triggers:
        try:
            # The user's expression alone first, so Spark's message is about it
            # ("... is not a boolean"), not about the CASE/coalesce around it.
            empty.filter(F.expr(t.when)).schema  # noqa: B018 - forces analysis (Spark Connect too)
            empty.filter(condition(t)).schema  # noqa: B018
        except Exception as exc:
            errors.append(
                f"{t.where}.when: Spark cannot use {t.when!r} as a condition: {spark_message(exc)}"
            )
        action = t.action
        if isinstance(action, EmitAction):
            for what, expression in (("key", action.key), ("new", action.new)):
                if expression is None:
                    continue
                try:
                    empty.select(_emit_value(what, expression)).schema  # noqa: B018
                except Exception as exc:
                    errors.append(
                        f"{t.where}.action.{what}: Spark cannot use {expression!r}: "
                        f"{spark_message(exc)}"
                    )
        elif isinstance(action, SqlAction):
            problem = _analyze_statement(spark, empty, t, action, sql_lock)
            if problem:
                errors.append(f"{t.where}.action.statement: {problem}")
    return errors


def _analyze_statement(
    spark: Any, empty: Any, t: Trigger, action: SqlAction, lock: threading.Lock
) -> str | None:
    with lock:
        try:
            _matched_frame(empty, t).createOrReplaceTempView(MATCHED_VIEW)
            plan = spark.sql("EXPLAIN EXTENDED " + action.statement).collect()[0][0]
        except Exception as exc:
            return f"Spark cannot run it: {spark_message(exc)}"
        finally:
            _drop_view(spark)
    problem = _explain_error(str(plan))
    return f"Spark cannot run it: {problem}" if problem else None


def _matched_frame(df: Any, t: Trigger) -> Any:
    """The ``matched`` view of a sql action: the batch columns plus idempotency_key."""
    F = _functions()
    key = F.concat(F.lit(t.name + ":"), F.col("lsn").cast("string"))
    return df.withColumn("idempotency_key", key)


def _drop_view(spark: Any) -> None:
    # A missing view is fine; never let cleanup mask the statement's own error.
    with contextlib.suppress(Exception):
        spark.catalog.dropTempView(MATCHED_VIEW)


# --------------------------------------------------------------------------
# Evaluation (every batch)


@dataclass(slots=True)
class SqlOutcome:
    error: str | None  # None: the statement succeeded
    seconds: float


@dataclass(slots=True)
class Evaluation:
    """What ``run_in_spark`` hands to ``finish``: the trigger set it used,
    each trigger's matched rows in LSN order, and the sql actions' outcomes."""

    triggers: Mapping[str, Trigger]
    matched: dict[str, list[rowsmod.Row]] = field(default_factory=dict)
    sql: dict[str, SqlOutcome] = field(default_factory=dict)
    spark_seconds: float = 0.0
    selection: Selection | None = None  # the Columns used, for the next batch


class Selection:
    """The Columns of one batch job for a trigger set: the filter and the select list.

    A Column is an unresolved expression, so one set serves every batch's
    DataFrame. Building it takes ~30 py4j calls (each trigger's condition, the
    row document's struct of 12 columns); built once per trigger set they no
    longer add 10-30 ms to every batch (more on a loaded machine).
    """

    __slots__ = ("active", "filter", "selected", "spark")

    def __init__(self, spark: Any, active: Sequence[Trigger]) -> None:
        F = _functions()
        self.spark = spark
        self.active = tuple(active)
        conds = [condition(t) for t in active]
        self.filter = functools.reduce(operator.or_, conds)
        self.selected = [F.col("lsn"), _doc_column().alias("doc")]
        for i, (t, cond) in enumerate(zip(active, conds, strict=True)):
            self.selected.append(cond.alias(f"m{i}"))
            self.selected.extend(_emit_columns(t, cond, i))

    def serves(self, spark: Any, active: Sequence[Trigger]) -> bool:
        """Built for this session and these very Trigger objects (a reload makes new ones)."""
        return (
            spark is self.spark
            and len(active) == len(self.active)
            and all(a is b for a, b in zip(active, self.active, strict=True))
        )


def evaluate(
    spark: Any,
    df: Any,
    triggers: Mapping[str, Trigger],
    batch_id: int,
    sql_lock: threading.Lock,
    clock: Any = time.perf_counter,
    selection: Selection | None = None,
) -> Evaluation:
    """One Spark job for all enabled triggers; ``selection`` (from an earlier
    batch) is reused when it was built for the same session and trigger set."""
    started = clock()
    active = [t for t in triggers.values() if t.enabled]
    result = Evaluation(triggers)
    if not active:
        return result
    if selection is None or not selection.serves(spark, active):
        selection = Selection(spark, active)
    result.selection = selection
    frame = df.filter(selection.filter).select(*selection.selected)
    try:
        # collect(), not toArrow(): matched sets are small next to the batch, and
        # toArrow's fixed cost per job doubled the stage time on 10k-row batches
        # (bench/bench_triggers.py); the heavy column (doc) is one string either way.
        rows = frame.collect()
    except Exception as exc:
        raise _blame(df, active, batch_id, exc) from exc

    names = frame.columns
    columns = list(zip(*rows, strict=True)) if rows else [() for _ in names]
    by_name = dict(zip(names, columns, strict=True))
    lsns: Sequence[int] = by_name["lsn"]
    docs: Sequence[str] = by_name["doc"]
    order = sorted(range(len(lsns)), key=lsns.__getitem__)  # LSN order = per-key order
    for i, t in enumerate(active):
        mask: Sequence[bool] = by_name[f"m{i}"]
        keys = by_name.get(f"k{i}")
        news = by_name.get(f"n{i}")
        matched: list[rowsmod.Row] = []
        for j in order:
            if not mask[j]:
                continue
            doc = rowsmod.with_key(t.name, lsns[j], docs[j].encode())
            if keys is not None or news is not None:
                extra: dict[str, Any] = {}
                if keys is not None:
                    extra["key"] = keys[j]
                if news is not None:
                    extra["new"] = msgspec.Raw(news[j].encode()) if news[j] is not None else None
                doc = rowsmod.with_member(doc, "emit", msgspec.json.encode(extra))
            matched.append(rowsmod.Row(lsns[j], doc))
        if matched:
            result.matched[t.name] = matched

    for t in active:
        if isinstance(t.action, SqlAction) and t.name in result.matched:
            result.sql[t.name] = run_sql(spark, df.filter(condition(t)), t, t.action, sql_lock)
    result.spark_seconds = clock() - started
    return result


def _blame(df: Any, active: Sequence[Trigger], batch_id: int, exc: Exception) -> Exception:
    """Find which trigger's expression failed at run time, for a message that names it."""
    with _quiet_pyspark_errors():
        return _find_culprit(df, active, batch_id, exc)


def _find_culprit(df: Any, active: Sequence[Trigger], batch_id: int, exc: Exception) -> Exception:
    for t in active:
        try:
            df.filter(condition(t)).select(*_emit_columns(t, condition(t), 0)).limit(1).count()
        except Exception as inner:
            return TriggerEvaluationError(
                f"{t.where} failed at run time on batch {batch_id}: {spark_message(inner)}. "
                f"The batch is retried; fix the trigger (for example try_variant_get or "
                f"try_cast instead of ::) and reload with SIGHUP, or set enabled = false."
            )
    return TriggerEvaluationError(f"trigger evaluation failed on batch {batch_id}: "
                                  f"{spark_message(exc)}")  # fmt: skip


def run_sql(
    spark: Any, matched: Any, t: Trigger, action: SqlAction, lock: threading.Lock
) -> SqlOutcome:
    """Run a sql action's statement over the temp view ``matched``."""
    started = time.perf_counter()
    with lock:  # one ``matched`` view per session: batches and retries take turns
        try:
            _matched_frame(matched, t).createOrReplaceTempView(MATCHED_VIEW)
            spark.sql(action.statement)
        except Exception as exc:
            return SqlOutcome(spark_message(exc), time.perf_counter() - started)
        finally:
            _drop_view(spark)
    return SqlOutcome(None, time.perf_counter() - started)


# Batch columns as strings, to rebuild a DataFrame from stored row documents.
_STRING_SCHEMA = (
    "lsn BIGINT, core INT, seq BIGINT, collection STRING, op STRING, key STRING, "
    "new STRING, old STRING, ingest_ts TIMESTAMP, batch_id BIGINT, depth INT, source STRING"
)


class _StoredRow(msgspec.Struct):
    lsn: int
    core: int
    seq: int
    collection: str
    op: str
    key: str
    new: msgspec.Raw
    old: msgspec.Raw
    ingest_ts: str | None
    batch_id: int
    depth: int
    source: str


_stored_decoder = msgspec.json.Decoder(_StoredRow)


def _raw_text(raw: msgspec.Raw) -> str | None:
    text = bytes(raw).decode()
    return None if text == "null" else text


def frame_from_docs(spark: Any, docs: Sequence[bytes]) -> Any:
    """Rebuild the batch DataFrame of stored rows (a sql action's retry)."""
    F = _functions()
    data = []
    for doc in docs:
        r = _stored_decoder.decode(doc)
        ts = datetime.fromisoformat(r.ingest_ts) if r.ingest_ts else None
        data.append(
            (r.lsn, r.core, r.seq, r.collection, r.op, r.key, _raw_text(r.new),
             _raw_text(r.old), ts, r.batch_id, r.depth, r.source)
        )  # fmt: skip
    frame = spark.createDataFrame(data, _STRING_SCHEMA)
    return frame.withColumn("new", F.parse_json("new")).withColumn("old", F.parse_json("old"))
