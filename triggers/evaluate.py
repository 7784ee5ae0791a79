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

Poison rows. A ``when`` (or emit expression) can still fail at run time on a
row of its own collection (an ANSI cast of ``"lots"``). Then, and only then,
the batch is split (a clean batch costs nothing extra):

1. Each trigger alone, full selection: those that pass are evaluated; the
   ones that fail are the culprits.
2. Per culprit, one job over the rows of its collection: the *suspects*
   are those where its ``when`` (and emit expressions) come out NULL once
   every cast in them is a TRY cast (a failing cast gives NULL instead of an
   error); the job brings their documents, and evaluates the other rows as
   usual under a CASE that keeps the failing casts off the suspects. The
   DataFrame is persisted for the splits unless the executor already did.
3. The others passed, so the failing rows are among the suspects: one
   suspect is the failing row; more are bisected (a set that passes is
   evaluated as usual, one that fails is halved down to single rows), at most
   ``MAX_POISON_ROWS_PER_BATCH`` of them in at most ``MAX_SPLIT_JOBS_PER_BATCH``
   jobs; past either the rest of the suspects are not evaluated. One poison
   cast thus costs one job beyond the batch's failed one, whatever the batch
   size (a bisection of the whole batch cost ~1.5 log2(n) jobs per poison
   row: 55 jobs and 31 s for 4 poison rows in 200 on the loaded 2-core box).
   If that job fails all the same (a division by zero, a UDF: no cast), the
   trigger's rows are bisected by LSN range instead.
4. Per culprit, the row documents of its failing and unevaluated rows (from
   step 2's job, or one more job after a range bisection); they go to the
   trigger's DLQ marked ``"stage": "when"`` (see ``triggers.rows``), so a
   replay evaluates ``when`` again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import re
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

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
# Most rows of one trigger isolated one by one in one batch (each with its own
# error). A trigger failing on more is broken, not unlucky: the rest of its
# rows in the batch go to the DLQ unevaluated, at the cost of one more job.
MAX_POISON_ROWS_PER_BATCH = 64
# Most splitting jobs per culprit trigger per batch: the bound on time, which
# the row cap alone is not. One poison row among n rows costs ~1.5 log2(n)
# jobs (26-30 measured at 100k rows); p adjacent ones ~2 each, so 64 fit; p
# spread-out ones ~30 each at 100k rows, so ~5 fit. 160 jobs took 34 s on a
# 100k-row batch on the 2-core box at load 8-9 (docs/triggers.md, "Poison
# rows"), against ~2 s for the clean batch: slow, but bounded, once per batch.
MAX_SPLIT_JOBS_PER_BATCH = 160


def spark_message(exc: BaseException) -> str:
    """Spark's own message, first line (error class, text, SQLSTATE, position)."""
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return line if len(line) <= _MESSAGE_MAX else line[: _MESSAGE_MAX - 3] + "..."


def _functions() -> Any:
    from pyspark.sql import functions as F  # pyspark loads lazily

    return F


def _gate(t: Trigger) -> Any:
    """The rows the trigger looks at (collection, ops, depth): plain comparisons, never fail."""
    F = _functions()
    gate = (F.col("collection") == F.lit(t.collection)) & F.col("op").isin(list(t.on))
    if not t.fire_on_derived:
        gate = gate & (F.col("depth") == F.lit(0))
    return gate


def condition(t: Trigger) -> Any:
    """The trigger's boolean Column over the batch DataFrame."""
    F = _functions()
    return F.when(_gate(t), F.coalesce(F.expr(t.when), F.lit(False))).otherwise(F.lit(False))


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


class PoisonRow(NamedTuple):
    """A row the trigger could not evaluate: it goes to the trigger's DLQ."""

    lsn: int
    doc: bytes  # idempotency key first, ``"stage": "when"`` last (rows.unevaluated)
    error: str


@dataclass(slots=True)
class Evaluation:
    """What ``run_in_spark`` hands to ``finish``: the trigger set it used,
    each trigger's matched rows in LSN order, the sql actions' outcomes, and
    the rows each trigger failed on (poison, for its DLQ)."""

    triggers: Mapping[str, Trigger]
    matched: dict[str, list[rowsmod.Row]] = field(default_factory=dict)
    sql: dict[str, SqlOutcome] = field(default_factory=dict)
    spark_seconds: float = 0.0
    selection: Selection | None = None  # the Columns used, for the next batch
    poisoned: dict[str, list[PoisonRow]] = field(default_factory=dict)  # in LSN order
    capped: set[str] = field(default_factory=set)  # isolation stopped at a cap (rows, jobs)
    # Set only when the batch job failed and the batch was split:
    batch_error: str | None = None  # Spark's message for the failed batch job
    isolation_jobs: int = 0  # the Spark jobs spent after it


class Selection:
    """The Columns of one batch job for a trigger set: the filter and the select list.

    A Column is an unresolved expression, so one set serves every batch's
    DataFrame. Building it takes ~30 py4j calls (each trigger's condition, the
    row document's struct of 14 columns); built once per trigger set they no
    longer add 10-30 ms to every batch (more on a loaded machine).
    """

    __slots__ = ("active", "filter", "names", "selected", "spark")

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
        # The select list's names, known without asking Spark (a py4j round trip).
        self.names = ["lsn", "doc"]
        for i, t in enumerate(active):
            self.names.append(f"m{i}")
            if isinstance(t.action, EmitAction):
                self.names += [f"{c}{i}" for c, e in (("k", t.action.key), ("n", t.action.new))
                               if e is not None]  # fmt: skip

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
    held: Collection[str] = (),
) -> Evaluation:
    """One Spark job for all enabled triggers; ``selection`` (from an earlier
    batch) is reused when it was built for the same session and trigger set.
    Triggers in ``held`` (paused by an operator) are evaluated, but their sql
    statements do not run: the engine queues their rows instead.

    A row that makes a trigger fail is isolated (module docstring, steps 1-4)
    and comes back in ``poisoned``; the rest is evaluated as usual. Raises
    only when Spark itself fails (not an error about a row), for the batch
    to be retried.
    """
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
        if not _row_error(exc):
            raise _blame(exc, batch_id) from exc
        with _quiet_pyspark_errors():
            _isolate(spark, df, active, f"batch {batch_id}", exc, result)
    else:
        _add_matched(result, active, selection.names, rows)

    for t in active:
        if isinstance(t.action, SqlAction) and t.name in result.matched and t.name not in held:
            matched = df.filter(condition(t))
            if t.name in result.poisoned:
                # Not the condition again: it fails on the poison rows.
                matched = frame_from_docs(spark, [r.doc for r in result.matched[t.name]])
            result.sql[t.name] = run_sql(spark, matched, t, t.action, sql_lock)
    result.spark_seconds = clock() - started
    return result


def reevaluate(spark: Any, t: Trigger, docs: Sequence[bytes]) -> Evaluation:
    """Replay of rows dead-lettered before ``when`` answered: evaluate ``t`` over them.

    Rows that match come back in ``matched`` (documents exactly as a batch
    renders them), rows that still fail in ``poisoned``; the others did not
    match. Blocking (py4j).
    """
    result = Evaluation({t.name: t})
    df = frame_from_docs(spark, docs)
    selection = Selection(spark, [t])
    try:
        rows = df.filter(selection.filter).select(*selection.selected).collect()
    except Exception as exc:
        if not _row_error(exc):
            raise
        with _quiet_pyspark_errors():
            _isolate(spark, df, [t], "the replayed rows", exc, result)
    else:
        _add_matched(result, [t], selection.names, rows)
    return result


def _add_matched(
    result: Evaluation, active: Sequence[Trigger], names: Sequence[str], rows: Sequence[Any]
) -> None:
    """Rows of a job over ``Selection(active)`` -> each trigger's matched rows, in LSN order."""
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


def _row_error(exc: BaseException) -> bool:
    """An error Spark raised about the data (it has an error condition such as
    INVALID_VARIANT_CAST), not a failure of Spark itself (py4j, a stopped
    session, an internal error): only the former is worth splitting the batch."""
    get = getattr(exc, "getCondition", None)
    cond = get() if callable(get) else None
    return isinstance(cond, str) and not cond.startswith("INTERNAL_ERROR")


def _blame(exc: Exception, batch_id: int) -> Exception:
    return TriggerEvaluationError(f"trigger evaluation failed on batch {batch_id}: "
                                  f"{spark_message(exc)}; the batch is retried")  # fmt: skip


@dataclass(slots=True)
class _Bisection:
    """One culprit's split of the batch: what passed, what failed, what was left."""

    trigger: Trigger
    selection: Selection
    lsns: Sequence[int]  # the batch's distinct LSNs, sorted
    rows: list[Any] = field(default_factory=list)  # rows of the passing ranges' jobs
    failed: dict[int, str] = field(default_factory=dict)  # poison LSN -> Spark's message
    left: list[tuple[int, int]] = field(default_factory=list)  # LSN ranges not evaluated
    capped: str = ""  # why the rest was left: "" (it was not), "rows" or "jobs"
    jobs: int = 0
    # ``lsns`` are exactly the rows to look at (suspects: a few), not range bounds.
    exact: bool = False


def _isolate(
    spark: Any,
    df: Any,
    active: Sequence[Trigger],
    scope: str,
    exc: Exception,
    result: Evaluation,
) -> None:
    """Steps 1-4 of the module docstring, after the batch job failed with ``exc``."""
    result.batch_error = spark_message(exc)
    # Step 1. Each trigger alone; those that pass are evaluated.
    culprits: list[tuple[Selection, str]] = []
    if len(active) == 1:  # alone already: the batch job was its job
        culprits.append((Selection(spark, active), result.batch_error))
        active = []
    for t in active:
        selection = Selection(spark, [t])
        result.isolation_jobs += 1
        try:
            rows = df.filter(selection.filter).select(*selection.selected).collect()
        except Exception as inner:
            if not _row_error(inner):
                raise TriggerEvaluationError(
                    f"trigger evaluation failed on {scope}: {spark_message(inner)}"
                ) from inner
            culprits.append((selection, spark_message(inner)))
        else:
            _add_matched(result, [t], selection.names, rows)
    if not culprits:
        return  # every trigger passed alone: the batch job's failure was not about a row
    cached = not getattr(df, "is_cached", True)
    if cached:
        df = df.persist()  # the splits read the batch again and again
    try:
        for selection, error in culprits:
            t = selection.active[0]
            # Step 2. One job: the suspects (their documents), and the others evaluated.
            result.isolation_jobs += 1
            split = _split_suspects(spark, df, t, selection)
            docs: dict[int, str] = {}
            if split is not None:
                rows, docs = split
                suspects = sorted(docs)
                b = _Bisection(t, selection, suspects, rows=rows, exact=True)
                # Step 3. The others passed, so the suspects hold the failing rows.
                if len(suspects) == 1:
                    b.failed[suspects[0]] = error
                elif suspects:
                    _bisect(df, b, 0, len(suspects) - 1, known_failing=True)
            else:
                # Not only casts fail (or no rewrite here): bisect the trigger's rows.
                result.isolation_jobs += 1
                lsns = sorted(r[0] for r in df.filter(_gate(t)).select("lsn").collect())
                b = _Bisection(t, selection, lsns)
                if lsns:
                    _bisect(df, b, 0, len(lsns) - 1, known_failing=True)
            _add_matched(result, [t], selection.names, b.rows)
            # Step 4. Documents of the failing and unevaluated rows (one job, if
            # step 2 did not bring them)
            poisoned = _poison_rows(df, b, scope, error, docs)
            result.isolation_jobs += b.jobs
            if poisoned:
                result.poisoned[t.name] = poisoned
            if b.capped:
                result.capped.add(t.name)
    finally:
        if cached:
            df.unpersist(blocking=False)


def _bisect(df: Any, b: _Bisection, lo: int, hi: int, known_failing: bool) -> bool:
    """Evaluate ``b.trigger`` on ``b.lsns[lo..hi]``; True if a row there failed.

    ``known_failing``: the parent range failed and its left half passed, so
    this range fails too and its own job is skipped (it is split at once).
    """
    if not b.capped and b.jobs >= MAX_SPLIT_JOBS_PER_BATCH:
        b.capped = "jobs"
    if b.capped:
        b.left.append((b.lsns[lo], b.lsns[hi]))
        return True
    if not known_failing or lo == hi:
        first, last = b.lsns[lo], b.lsns[hi]
        F = _functions()
        if b.exact:
            in_range = F.col("lsn").isin(list(b.lsns[lo : hi + 1]))
        else:
            in_range = F.col("lsn").between(first, last)
        # CASE: the condition never runs on rows outside the range.
        cond = F.when(in_range, b.selection.filter).otherwise(F.lit(False))
        b.jobs += 1
        try:
            rows = df.filter(in_range).filter(cond).select(*b.selection.selected).collect()
        except Exception as exc:
            if not _row_error(exc):
                raise
            if lo == hi:
                if len(b.failed) >= MAX_POISON_ROWS_PER_BATCH:
                    b.capped = "rows"
                    b.left.append((first, last))
                else:
                    b.failed[first] = spark_message(exc)
                return True
        else:
            b.rows.extend(rows)
            return False
    mid = (lo + hi) // 2
    left_failed = _bisect(df, b, lo, mid, known_failing=False)
    right_failed = _bisect(df, b, mid + 1, hi, known_failing=not left_failed)
    return left_failed or right_failed


_CAST = "org.apache.spark.sql.catalyst.expressions.Cast"


# The rewrite walks the expression tree over py4j (tens of calls): done once per
# session and expression, the Column is reused (it is unresolved, like Selection's).
@functools.lru_cache(maxsize=256)
def _try_column(spark: Any, expression: str) -> Any:
    """``expression`` with every cast in TRY mode (a failing cast gives NULL), as a
    Column; None when the rewrite is not possible here (Spark Connect, another
    Spark). Plain ANSI-off mode does not do it: a VARIANT cast fails in both."""
    try:
        from pyspark.sql import Column

        jvm = spark._jvm
        convert = jvm.scala.jdk.javaapi.CollectionConverters
        expressions = jvm.org.apache.spark.sql.catalyst.expressions
        try_mode = expressions.EvalMode.TRY()

        def rewrite(node: Any) -> Any:
            children = [rewrite(c) for c in convert.asJava(node.children())]
            if children:
                seq = convert.asScala(jvm.java.util.ArrayList(children)).toSeq()
                node = node.withNewChildren(seq)
            if node.getClass().getName() == _CAST:
                node = expressions.Cast(node.child(), node.dataType(), node.timeZoneId(), try_mode)
            return node

        parsed = spark._jsparkSession.sessionState().sqlParser().parseExpression(expression)
        return Column(jvm.org.apache.spark.sql.classic.ExpressionUtils.column(rewrite(parsed)))
    except Exception:
        return None


def _split_suspects(
    spark: Any, df: Any, t: Trigger, selection: Selection
) -> tuple[list[Any], dict[int, str]] | None:
    """One job over the rows ``t`` looks at: ``(the others' rows of its
    selection, evaluated as usual; suspect LSN -> its document)``.

    A suspect's ``when`` (or emit expression) is NULL once every cast in it is
    a TRY cast: where a cast failed (or the value is NULL anyway). The others
    are evaluated under a CASE, so the failing casts never run on suspects.
    None when the rewrite is not possible, or when the job fails all the same
    (a division by zero, a UDF: no cast): the caller bisects by LSN range.
    """
    F = _functions()
    when = _try_column(spark, t.when)
    if when is None:
        return None
    suspect = when.isNull()
    action = t.action
    if isinstance(action, EmitAction):
        # Emit expressions run on matched rows only (``_emit_columns``).
        for expression in (action.key, action.new):
            if expression is not None:
                value = _try_column(spark, expression)
                if value is not None:
                    suspect = suspect | (F.coalesce(when, F.lit(False)) & value.isNull())
    names = selection.names
    gated = df.filter(_gate(t)).withColumn("_suspect", suspect)
    others = gated.filter(
        F.when(~F.col("_suspect"), selection.filter).otherwise(F.lit(False))
    ).select(*selection.selected, F.lit(False).alias("_suspect"))
    suspects = gated.filter(F.col("_suspect")).select(
        F.col("lsn"),
        _doc_column().alias("doc"),
        *[F.lit(None).alias(n) for n in names[2:]],
        F.lit(True).alias("_suspect"),
    )
    try:
        rows = others.unionByName(suspects).collect()
    except Exception as exc:
        if not _row_error(exc):
            raise
        return None
    docs = {r[0]: r[1] for r in rows if r[-1]}
    return [tuple(r)[: len(names)] for r in rows if not r[-1]], docs


def _poison_rows(
    df: Any, b: _Bisection, scope: str, first_error: str, docs: Mapping[int, str]
) -> list[PoisonRow]:
    """The failing rows with their own errors, the rows left by the cap with one
    saying so. Their documents come from ``docs`` (the suspects') or one job."""
    if not b.failed and not b.left:
        return []
    t = b.trigger
    if b.exact:  # the rows are suspects: ranges of them, then their documents
        left = [lsn for lo, hi in b.left for lsn in b.lsns if lo <= lsn <= hi]
        found = [(lsn, docs[lsn]) for lsn in (*b.failed, *left) if lsn in docs]
    else:
        F = _functions()
        where = F.col("lsn").isin(list(b.failed)) if b.failed else F.lit(False)
        for first, last in b.left:
            where = where | F.col("lsn").between(first, last)
        b.jobs += 1
        found = df.filter(_gate(t) & where).select("lsn", _doc_column().alias("doc")).collect()
    why = (
        f"failed on more than {MAX_POISON_ROWS_PER_BATCH} rows of {scope}"
        if b.capped == "rows"
        else f"failed on rows of {scope} that took more than {MAX_SPLIT_JOBS_PER_BATCH} "
        "Spark jobs to isolate"
    )
    left_error = (
        f"not evaluated: trigger {t.name!r} {why}, so its other rows there were not "
        f"evaluated either (first error: {first_error}); fix the trigger, reload, then "
        "`eventplane dlq replay`"
    )
    out = []
    for lsn, doc in sorted(found, key=operator.itemgetter(0)):
        error = b.failed.get(lsn)
        message = f"evaluation failed on this row: {error}" if error is not None else left_error
        out.append(PoisonRow(lsn, rowsmod.unevaluated(t.name, lsn, doc.encode()), message))
    return out


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
    "new STRING, old STRING, ingest_ts TIMESTAMP, batch_id BIGINT, "
    "event_id STRING, event_time TIMESTAMP, producer STRING, depth INT, source STRING"
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
    # Absent from rows stored (retry queue, DLQ) before these columns existed.
    event_id: str | None = None
    event_time: str | None = None
    producer: str | None = None


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
        event_ts = datetime.fromisoformat(r.event_time) if r.event_time else None
        data.append(
            (r.lsn, r.core, r.seq, r.collection, r.op, r.key, _raw_text(r.new),
             _raw_text(r.old), ts, r.batch_id, r.event_id, event_ts, r.producer, r.depth,
             r.source)
        )  # fmt: skip
    frame = spark.createDataFrame(data, _STRING_SCHEMA)
    return frame.withColumn("new", F.parse_json("new")).withColumn("old", F.parse_json("old"))
