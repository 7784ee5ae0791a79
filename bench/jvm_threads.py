"""Where a JVM's CPU goes, by thread kind, from /proc/<pid>/task/*/stat.

``python -m bench.jvm_threads PID [--seconds S]`` samples a running JVM (or the
first ``java`` process below PID) twice, S seconds apart, and prints the CPU
each kind of thread used in between. ``bench_pipeline --jvm-threads`` does the
same around the daemon's throughput run (docs/performance.md, "The daemon's
JVM by thread").

Threads are grouped by the name the JVM gives them (Linux keeps the first 15
bytes): the JIT compilers (C2, C1), the garbage collector's threads, Spark's
task threads ("Executor task launch worker ..."), and the rest under their own
name with digits dropped. CPU of threads that exited between the samples is
the process's total minus its live threads': shown as "(exited threads)".
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence

from bench.common import _stat

# First match wins; the names are HotSpot's (Java 17) and Spark's thread names,
# cut to 15 bytes by the kernel.
KINDS: tuple[tuple[str, str], ...] = (
    ("C2 Compiler", "JIT: C2 compiler"),
    ("C1 Compiler", "JIT: C1 compiler"),
    ("Sweeper", "JIT: code cache sweeper"),
    ("GC Thread", "GC: parallel workers"),
    ("G1 ", "GC: G1 concurrent / refinement"),
    ("VM Thread", "VM thread (safepoints, GC pauses)"),
    ("Executor task", "Spark task threads"),
    ("java", "main thread (launcher)"),
)
EXITED = "(exited threads)"


def find_jvm(root: int) -> int | None:
    """``root`` if it is a ``java`` process, else the first ``java`` below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(int(_stat(entry)[1]), []).append(int(entry))
            except (OSError, IndexError):
                continue
    todo = [root]
    while todo:
        pid = todo.pop(0)
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
                if f.read().strip() == "java":
                    return pid
        except OSError:
            continue
        todo.extend(sorted(children.get(pid, ())))
    return None


def kind_of(name: str) -> str:
    for prefix, kind in KINDS:
        if name.startswith(prefix):
            return kind
    return re.sub(r"[-#]?\d+$", "", name).strip() or name


def sample(pid: int) -> dict[str, float]:
    """CPU seconds per thread kind so far, plus the process total under ``""``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    live = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                name = f.read().strip()
            fields = _stat(f"{pid}/task/{tid}")
        except (OSError, IndexError):
            continue  # the thread exited while we read
        cpu = (int(fields[11]) + int(fields[12])) / tick
        live += cpu
        kind = kind_of(name)
        out[kind] = out.get(kind, 0.0) + cpu
    fields = _stat(pid)
    out[""] = (int(fields[11]) + int(fields[12])) / tick
    out[EXITED] = out[""] - live
    return out


def diff(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


def render(delta: Mapping[str, float], per: float = 0.0, title: str = "") -> str:
    """A table of ``delta`` (CPU s per kind), biggest first; ``per``: events, to
    add a CPU-s-per-million column."""
    total = delta.get("", 0.0)
    head = "| thread kind | CPU s | share |" + (" CPU s / M events |" if per else "")
    out = [title, "", head, "|---|---:|---:|" + ("---:|" if per else "")] if title else [head]
    if not title:
        out.append("|---|---:|---:|" + ("---:|" if per else ""))
    for kind, cpu in sorted(delta.items(), key=lambda kv: -kv[1]):
        if not kind or abs(cpu) < 0.005:
            continue
        share = f"{100 * cpu / total:.0f} %" if total else "-"
        extra = f" {cpu * 1e6 / per:.2f} |" if per else ""
        out.append(f"| {kind} | {cpu:.2f} | {share} |{extra}")
    extra = f" {total * 1e6 / per:.2f} |" if per else ""
    out.append(f"| total | {total:.2f} | 100 % |{extra}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.jvm_threads", description=__doc__)
    p.add_argument("pid", type=int, help="a JVM, or a process with a JVM below it")
    p.add_argument("--seconds", type=float, default=10.0, help="between the samples (10)")
    args = p.parse_args(argv)
    jvm = find_jvm(args.pid)
    if jvm is None:
        print(f"no java process at or below pid {args.pid}", file=sys.stderr)
        return 1
    before = sample(jvm)
    time.sleep(args.seconds)
    print(render(diff(before, sample(jvm)), title=f"JVM {jvm}, {args.seconds:g} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
