"""Run every benchmark (``make bench``) or some: ``python -m bench wal ingest``.

Each ``bench/bench_<name>.py`` module runs in its own process so one JVM or
one crashed run cannot skew the next; extra flags after ``--`` are passed on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    names, _, extra = (
        (argv, None, [])
        if "--" not in argv
        else (argv[: argv.index("--")], None, argv[argv.index("--") + 1 :])
    )
    here = Path(__file__).parent
    available = sorted(p.stem.removeprefix("bench_") for p in here.glob("bench_*.py"))
    chosen = names or available
    unknown = [n for n in chosen if n not in available]
    if unknown:
        print(
            f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(available)}",
            file=sys.stderr,
        )
        return 2
    failed = []
    for name in chosen:
        print(f"\n=== bench {name} ===", flush=True)
        rc = subprocess.call([sys.executable, "-m", f"bench.bench_{name}", *extra])
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
