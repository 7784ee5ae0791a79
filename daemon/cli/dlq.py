"""``eventplane dlq list|replay|purge``: look at and act on dead-lettered rows.

Works on the trigger store (``<data_dir>/triggers/queue.sqlite3``) directly,
with or without a running daemon: SQLite's locking makes the two safe
together, and a running daemon's retry loop picks replayed entries up within
a second. Exit codes: 0 done, 1 nothing matched or the command was refused.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TextIO

from daemon.config import Config
from triggers.errors import StoreError
from triggers.store import DlqEntry, TriggerStore, store_path

_ERROR_WIDTH = 70
_KEY_WIDTH = 24


def main(args: argparse.Namespace, cfg: Config, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    path = store_path(cfg.data_dir)
    if not path.exists():
        if args.dlq_command == "replay":
            print(f"eventplane: nothing to replay (no trigger store at {path})", file=sys.stderr)
            return 1
        print(f"The DLQ is empty (no trigger store at {path}).", file=out)
        return 0
    try:
        store = TriggerStore(path, cfg.dlq.max_entries)
    except StoreError as exc:
        print(f"eventplane: {exc}", file=sys.stderr)
        return 1
    try:
        if args.dlq_command == "list":
            return _list(store, args.trigger, args.limit, out)
        if args.dlq_command == "replay":
            return _replay(store, cfg, args.entry_id, args.trigger, out)
        if args.dlq_command == "purge":
            return _purge(store, args.trigger, out)
        raise AssertionError(f"unhandled dlq command {args.dlq_command}")  # argparse forbids it
    finally:
        store.close()


def _when(ts: float) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(entries: Sequence[DlqEntry]) -> list[str]:
    """Aligned columns, one line per entry; errors clipped to one line."""
    header = ("ID", "TRIGGER", "COLLECTION", "KEY", "OP", "LSN", "ATTEMPTS",
              "FIRST ATTEMPT", "LAST ATTEMPT", "LAST ERROR")  # fmt: skip
    rows = [
        (str(e.id), e.trigger, e.collection, _clip(e.key, _KEY_WIDTH), e.op, str(e.lsn),
         str(e.attempts), _when(e.first_attempt), _when(e.last_attempt),
         _clip(e.last_error, _ERROR_WIDTH))
        for e in entries
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = {0, 5, 6}
    lines = []
    for r in [header, *rows]:
        cells = [
            r[i].rjust(widths[i]) if i in numeric else r[i].ljust(widths[i]) for i in range(len(r))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _list(store: TriggerStore, trigger: str | None, limit: int, out: TextIO) -> int:
    total = store.dlq_size(trigger)
    scope = f' of trigger "{trigger}"' if trigger else ""
    if total == 0:
        print(f"The DLQ has no entries{scope}.", file=out)
        return 0
    entries = store.dlq_list(trigger, max(limit, 0))
    for line in format_table(entries):
        print(line, file=out)
    print(f"\n{len(entries)} of {total} entries{scope} shown, oldest first.", file=out)
    return 0


def _replay(
    store: TriggerStore, cfg: Config, entry_id: int | None, trigger: str | None, out: TextIO
) -> int:
    configured = {t.name: t.batch_size for t in cfg.triggers}
    name = trigger
    if entry_id is not None:
        entry = store.dlq_get(entry_id)
        if entry is None:
            print(f"eventplane: no DLQ entry with id {entry_id}", file=sys.stderr)
            return 1
        name = entry.trigger
    if name not in configured:
        print(
            f'eventplane: trigger "{name}" is not in {cfg.source or "the configuration"}; '
            "replayed rows would come straight back. Entries stay in the DLQ.",
            file=sys.stderr,
        )
        return 1
    moved = store.dlq_replay(entry_id=entry_id, trigger=trigger, chunk_sizes=configured)
    if moved == 0:
        print(f'eventplane: the DLQ has no entries of trigger "{name}"', file=sys.stderr)
        return 1
    print(
        f'Moved {moved} entr{"y" if moved == 1 else "ies"} of trigger "{name}" back to the '
        "retry queue (due now; a running daemon delivers them within a second).",
        file=out,
    )
    return 0


def _purge(store: TriggerStore, trigger: str | None, out: TextIO) -> int:
    purged = store.dlq_purge(trigger)
    scope = f' of trigger "{trigger}"' if trigger else ""
    print(f"Purged {purged} DLQ entr{'y' if purged == 1 else 'ies'}{scope}.", file=out)
    return 0
