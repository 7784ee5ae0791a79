"""The fixed cost of a CDC micro-batch: many small batches through ``SparkExecutor``.

``python bench/bench_fixedcost.py [--batches 40] [--rows 2000] [--rounds 4] [--count]``

Runs from the working directory's source tree (its ``daemon`` package comes
first on the path), so the same file measures an older tree unpacked
elsewhere: ``cd /tmp/base && python /path/to/bench/bench_fixedcost.py``.

One stream of every collection, bench_cdc's events, the next batch handed to
``prepare`` while one runs (as the planner does); 10 untimed warm-up batches,
then ``--rounds`` rounds. Per round and batch: wall time; CPU of this process
(the Python half), of its JVM (utime + stime) and of the processes the JVM
forked and reaped (its cutime + cstime: Hadoop's ``chmod`` forks); the JVM's
CPU per thread (``/proc/<pid>/task``); Spark's codegen compilations. With
``--count``, every py4j command sent from Python, by kind; with ``--forks``, the
processes the JVM started (JFR's ``jdk.ProcessStart`` events), by command. ``--jfr FILE``
records the driver JVM with JFR's ``profile`` settings; ``--eventlog DIR``
writes Spark's event log, uncompressed. docs/performance.md, "The fixed cost
of a batch", has what it found.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.getcwd())  # the working directory's tree, not this file's

from bench.bench_cdc import executor_config, make_batches
from bench.common import _stat, process_tree, total_cpu_seconds
from daemon.plane.batch import MicroBatch
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from daemon.spark.session import _log4j2_file, build_session

TICK = os.sysconf("SC_CLK_TCK")
calls: collections.Counter[str] = collections.Counter()
call_s: collections.Counter[str] = collections.Counter()


def count_py4j() -> None:
    """Count (and time) every py4j command, by kind (and method, for calls)."""
    import py4j.clientserver as cs
    import py4j.java_gateway as jg

    for cls in (cs.JavaClient, jg.GatewayClient):
        orig = cls.send_command

        def send(self: Any, command: str, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _orig(self, command, *a, **k)
            finally:
                head = command.split("\n", 3)
                key = head[0] + ":" + (head[2] if len(head) > 2 and head[0] == "c" else "")
                calls[key] += 1
                call_s[key] += time.perf_counter() - t

        cls.send_command = send


def start_process_recording(spark: Any) -> Any:
    """A JFR recording of the processes the driver JVM starts (nothing else)."""
    recording = spark.sparkContext._jvm.jdk.jfr.Recording()
    recording.enable("jdk.ProcessStart")
    recording.start()
    return recording


def process_starts(spark: Any, recording: Any, dump: Path) -> collections.Counter[str]:
    """Stop ``recording``; the processes it saw start, by program name."""
    jvm = spark.sparkContext._jvm
    recording.stop()
    path = jvm.java.io.File(str(dump)).toPath()
    recording.dump(path)
    recording.close()
    out: collections.Counter[str] = collections.Counter()
    for e in jvm.jdk.jfr.consumer.RecordingFile.readAllEvents(path):
        out[os.path.basename(str(e.getString("command")).split()[0])] += 1
    dump.unlink(missing_ok=True)
    return out


def child_cpu(pids: list[int]) -> float:
    """CPU of the processes ``pids`` forked and reaped (cutime + cstime)."""
    return sum((int(_stat(p)[13]) + int(_stat(p)[14])) / TICK for p in pids)


def thread_cpu(pids: list[int]) -> collections.Counter[str]:
    """CPU seconds per thread name (digits folded) of ``pids``."""
    out: collections.Counter[str] = collections.Counter()
    for p in pids:
        for t in os.listdir(f"/proc/{p}/task"):
            try:
                raw = Path(f"/proc/{p}/task/{t}/stat").read_bytes()
            except OSError:
                continue
            name = raw[raw.index(b"(") + 1 : raw.rindex(b")")].decode()
            f = raw[raw.rindex(b")") + 2 :].split()
            out[re.sub(r"\d+", "N", name)] += (int(f[11]) + int(f[12])) / TICK
    return out


async def run(spark: Any, batches: list[MicroBatch], root: Path, jvm: list[int]) -> dict[str, Any]:
    ex = SparkExecutor(executor_config(root), Metrics(), wal_id="bench", session=spark)
    await ex.start()
    me = [os.getpid()]
    walls = []
    t0, c0 = thread_cpu(jvm), (total_cpu_seconds(me), total_cpu_seconds(jvm), child_cpu(jvm))
    started = time.perf_counter()
    for i, b in enumerate(batches):
        t = time.perf_counter()
        running = asyncio.ensure_future(ex.execute(b))
        if i + 1 < len(batches):
            ex.prepare(batches[i + 1])
        await running
        walls.append(time.perf_counter() - t)
    total = time.perf_counter() - started
    t1, c1 = thread_cpu(jvm), (total_cpu_seconds(me), total_cpu_seconds(jvm), child_cpu(jvm))
    await ex.stop()
    py, java, forked = (b - a for a, b in zip(c0, c1, strict=True))
    return {
        "walls": walls,
        "total": total,
        "py": py,
        "jvm": java,
        "forked": forked,
        "threads": t1 - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=40, help="batches per round (40)")
    p.add_argument("--rows", type=int, default=2000, help="rows per batch (2000)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--jfr", default="", help="record the driver JVM with JFR to this file")
    p.add_argument("--eventlog", default="", help="Spark's event log into this folder")
    p.add_argument("--conf", action="append", default=[], help="extra Spark conf key=value")
    p.add_argument("--count", action="store_true", help="count py4j commands")
    p.add_argument("--forks", action="store_true", help="count the processes the JVM starts")
    a = p.parse_args()
    conf = {"spark.sql.shuffle.partitions": "4", "spark.driver.memory": "4g"}
    for kv in a.conf:
        k, _, v = kv.partition("=")
        conf[k] = v
    if a.jfr:
        conf["spark.driver.extraJavaOptions"] = (
            f"-Dlog4j2.configurationFile=file:{_log4j2_file('ERROR')} "
            f"-XX:StartFlightRecording=filename={a.jfr},settings=profile,dumponexit=true"
        )
    if a.eventlog:
        os.makedirs(a.eventlog, exist_ok=True)
        conf.update({"spark.eventLog.enabled": "true", "spark.eventLog.dir": a.eventlog})
        conf["spark.eventLog.compress"] = "false"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = build_session("local[*]", "bench-fixedcost", False, "ERROR", conf)
    jvm = [q for q in process_tree(os.getpid()) if q != os.getpid()]
    root = Path(tempfile.mkdtemp(prefix="bench-fixedcost-"))
    batches = make_batches(a.batches * a.rows, a.rows)
    asyncio.run(run(spark, make_batches(10 * a.rows, a.rows), root / "warm", jvm))
    if a.count:
        count_py4j()
    cg = spark.sparkContext._jvm.org.apache.spark.metrics.source.CodegenMetrics
    for r in range(a.rounds):
        calls.clear()
        call_s.clear()
        compiled = cg.METRIC_COMPILATION_TIME().getCount()
        recording = start_process_recording(spark) if a.forks else None
        out = asyncio.run(run(spark, batches, root / f"r{r}", jvm))
        sent, sent_s = calls.copy(), call_s.copy()  # not the recording's read below
        started = process_starts(spark, recording, root / "forks.jfr") if recording else None
        n = len(batches)
        walls = out["walls"]
        ms = {k: 1000 * out[k] / n for k in ("total", "py", "jvm", "forked")}
        print(
            f"round {r + 1}: {n} batches x {a.rows} rows: wall {ms['total']:.0f} ms/batch "
            f"(median {1000 * statistics.median(walls):.0f}); CPU ms/batch: Python "
            f"{ms['py']:.0f}, JVM {ms['jvm']:.0f}, forked {ms['forked']:.0f}; "
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        compiled = cg.METRIC_COMPILATION_TIME().getCount() - compiled
        print(f"  codegen compilations per batch: {compiled / n:.2f}")
        top = out["threads"].most_common(12)
        print("  JVM threads, ms/batch: " + ", ".join(f"{k} {1000 * v / n:.0f}" for k, v in top))
        if started is not None:
            what = ", ".join(f"{k} {v / n:.2f}" for k, v in started.most_common(5))
            print(f"  processes started per batch: {sum(started.values()) / n:.2f} ({what})")
        if a.count:
            total = sum(sent.values())
            print(f"  py4j commands per batch: {total / n:.1f}")
            for k, v in sent.most_common(20):
                print(f"    {v / n:6.1f} {1000 * sent_s[k] / n:7.2f} ms  {k}")
        shutil.rmtree(root / f"r{r}", ignore_errors=True)
    spark.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
