"""The Python half of a batch: stored events -> the inbox Parquet file.

``python -m bench.bench_batch_build [--events N] [--part-rows 50,500,16384] [--rounds N]``

Builds a two-core micro-batch of ``bench_cdc``-like events (four collections,
two thirds updates, ~150-byte payloads) delivered in parts of ``--part-rows``
rows, as the consumers deliver them (a ring run per part: tens of rows at
20k events/s, thousands in a backlog), and writes its inbox file with
``daemon.spark.frame.write_batch_file`` two ways, alternating, in one process:

- **field reader**: the daemon's path, each chunk read a field at a time
  for all its events (``daemon.spark.unpack``);
- **per event**: the same chunks with the field reader turned off, so every
  chunk goes through one msgspec decode per event and Arrow columns built
  from Python objects (the general path, and how every chunk was read
  before the field reader).

With ``--baseline DIR`` a third side writes the same file with
``DIR/daemon/spark/frame.py`` (an older tree, e.g. ``git archive`` of an
earlier commit, unpacked), loaded beside this tree's modules: the code before
a change, measured in the same run.

It reports CPU microseconds per event (this process: the part of a batch
that holds the daemon's interpreter lock, plus pyarrow's Parquet write) and
checks that both files hold the same rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from unittest import mock

from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.plane.parts import Rows, pack
from daemon.spark import frame, unpack
from wal.record import Record

COLLECTIONS = ("orders", "users", "payments", "shipments")


def _payload(i: int, rng: random.Random) -> bytes:
    new = json.dumps(
        {"id": i, "amount": round(rng.random() * 2000, 2), "status": "paid", "n": i % 97}
    ).encode()
    op = "insert" if i % 3 == 0 else "update"
    old = None if op == "insert" else new
    return encode(StoredEvent(COLLECTIONS[i % 4], op, f"k{i % 50_000}", new, old, time.time_ns()))


def make_batch(events: int, part_rows: int, seed: int = 7) -> MicroBatch:
    rng = random.Random(seed)
    slices = {}
    for core in range(2):
        recs = [
            Record(2 * i + core + 1, core, i + 1, _payload(2 * i + core, rng))
            for i in range(events // 2)
        ]
        parts = [pack(recs[k : k + part_rows]) for k in range(0, len(recs), part_rows)]
        slices[core] = Slice(core, 1, len(recs), Rows(parts))
    return MicroBatch(1, slices)


def _load_frame(tree: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "baseline_frame", tree / "daemon" / "spark" / "frame.py"
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"no daemon/spark/frame.py under {tree}")
    module = importlib.util.module_from_spec(spec)
    # Registered first, as an import would: a dataclass in the module looks
    # its module up while it is being defined.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _build(batch: MicroBatch, path: Path, side: str, baseline: ModuleType | None) -> float:
    started = time.process_time()
    if side == "general":
        with mock.patch.object(unpack, "_columns", side_effect=unpack._Refused):
            frame.write_batch_file(batch, path, 2)
    elif side == "baseline" and baseline is not None:
        baseline.write_batch_file(batch, path, 2)
    else:
        frame.write_batch_file(batch, path, 2)
    return time.process_time() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--part-rows", default="50,500,16384", help="comma-separated part sizes")
    ap.add_argument("--rounds", type=int, default=5, help="best of N per side")
    ap.add_argument("--baseline", type=Path, help="an older source tree, as a third side")
    args = ap.parse_args(argv)
    import pyarrow.parquet as pq

    baseline = _load_frame(args.baseline) if args.baseline else None
    sides = ("fields", "general", "baseline") if baseline else ("fields", "general")
    extra_head = " baseline CPU us/event | baseline / field reader |" if baseline else ""

    print(f"load average {os.getloadavg()}; {args.events:,} events, best of {args.rounds}")
    print()
    print(
        "| rows per part | field reader CPU us/event | per event CPU us/event"
        " | per event / field reader |" + extra_head
    )
    print("|---:|---:|---:|---:|" + ("---:|---:|" if baseline else ""))
    with tempfile.TemporaryDirectory() as tmp:
        for rows in (int(x) for x in args.part_rows.split(",")):
            batch = make_batch(args.events, rows)
            best = dict.fromkeys(sides, float("inf"))
            for r in range(args.rounds):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    path = Path(tmp) / f"{side}.parquet"
                    best[side] = min(best[side], _build(batch, path, side, baseline))
            ours = pq.read_table(Path(tmp) / "fields.parquet")
            for side in sides[1:]:
                if not ours.equals(pq.read_table(Path(tmp) / f"{side}.parquet")):
                    print(f"the {side} file differs at {rows} rows per part")
                    return 1
            us = {k: v / args.events * 1e6 for k, v in best.items()}
            line = f"| {rows:,} | {us['fields']:.2f} | {us['general']:.2f} "
            line += f"| {us['general'] / us['fields']:.2f}x |"
            if baseline:
                line += f" {us['baseline']:.2f} | {us['baseline'] / us['fields']:.2f}x |"
            print(line)
    print()
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
