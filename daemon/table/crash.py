"""Crash points: named places where a test makes the process SIGKILL itself.

``EVENTPLANE_CRASH_AT=<name>[@<n>]`` kills the process the n-th time (default:
the first) it reaches ``crash_point(name)``; ``EVENTPLANE_PAUSE_AT`` (same
form) stops it there with SIGSTOP instead, for the test to SIGCONT later;
``EVENTPLANE_STALL_AT`` (same form) blocks the calling thread there from the
n-th arrival on, for ever: a store call that never answers, while the rest of
the process runs. The names are in
``CRASH_POINTS``; crash tests aim at each step of the table's protocols with
them (docs/cdc.md, "Crash points").
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV_CRASH_AT = "EVENTPLANE_CRASH_AT"
ENV_PAUSE_AT = "EVENTPLANE_PAUSE_AT"
ENV_STALL_AT = "EVENTPLANE_STALL_AT"
COMMIT_CRASH_POINTS = (
    "cdc.before_stage",  # nothing of the batch written
    "cdc.after_stage",  # staged files exist, no intent
    "cdc.after_quarantine",  # set-aside rows durable, no intent, not committed
    "cdc.after_intent",  # intent durable, nothing published
    "cdc.mid_publish",  # first file renamed, others still staged
    "cdc.after_publish",  # all files visible, ledger not updated
    "cdc.after_ledger",  # committed, intent and staging not cleaned
    "executor.after_commit",  # every sink and stage done, execute() not returned
)
# Retention of one partition (daemon/table/retention.py):
RETENTION_CRASH_POINTS = (
    "cdc.retention.before_rename",  # partition visible, nothing done
    "cdc.retention.after_rename",  # partition hidden (.expired-*), not logged
    "cdc.retention.after_log",  # hidden and logged, files not deleted
    "cdc.retention.mid_delete",  # hidden, logged, first file deleted
)
# A compaction's steps (daemon/table/compact.py): rolled back up to the swap,
# forward after it.
COMPACT_CRASH_POINTS = (
    "cdc.compact.after_write",  # merged files staged, no intent
    "cdc.compact.after_intent",  # intent durable, partition untouched
    "cdc.compact.mid_build",  # new folder partly built (hidden)
    "cdc.compact.before_swap",  # new folder complete and durable, not swapped
    "cdc.compact.after_swap",  # merged files visible, ledger not updated
    "cdc.compact.after_ledger",  # recorded; old folder, intent not removed
    "cdc.compact.mid_clean",  # old folder removed, intent not yet
)
# A replay of quarantined rows (CdcSink.replay_quarantine): rolled back before
# its intent, forward after it.
REPLAY_CRASH_POINTS = (
    "cdc.replay_after_intent",  # rows staged and listed, nothing published
    "cdc.replay_after_publish",  # rows visible, still in the quarantine file
)
# A Delta stream's commit (daemon/table/delta.py): the points of the
# Parquet commit it passes, and its own.
DELTA_CRASH_POINTS = (
    "cdc.before_stage",  # nothing of the batch written
    "cdc.after_quarantine",  # set-aside rows durable, nothing committed
    "delta.before_commit",  # data files in the table's folders, not in its log
    "delta.after_commit",  # Delta committed the batch, the ledger does not know
    "cdc.after_ledger",  # committed and recorded
    "executor.after_commit",  # every sink and stage done, execute() not returned
)
# A commit to a table on S3 (daemon/table/delta.py, mirror.py): after the
# writer's last lease and fence checks, before delta-rs writes the log entry.
S3_CRASH_POINTS = (
    "delta.before_log_commit",  # files uploaded, the log read, the entry not written
    "mirror.before_merge_commit",  # the lease and the log checked, the merge not run
)
# A mirror's commit (daemon/table/mirror.py).
MIRROR_CRASH_POINTS = (
    "mirror.before_commit",  # the batch reduced, nothing merged
    "mirror.after_commit",  # merged with its txn, the stage's progress not recorded
    "executor.after_commit",  # every sink and stage done, execute() not returned
)
# A replay of a mirror's quarantine (MirrorTable.replay_quarantine): rolled
# back before its merge commits, forward after it.
MIRROR_REPLAY_CRASH_POINTS = (
    "mirror.replay_after_intent",  # the intent durable, nothing merged
    "mirror.replay_after_commit",  # merged with its replay txn, still in the quarantine
)
# A mirror that coalesces its merges (merge_interval_ms, daemon/spark/mirrors.py);
# tests/integration/test_mirror_coalesce_crash.py aims at it.
COALESCE_CRASH_POINTS = (
    "mirror.coalesced",  # a batch held for a coalesced merge, its group not merged
)
# `eventplane cdc mirror rebuild` (daemon/table/mirrorrebuild.py): the old
# mirror in place and serving before the switch, the new one after it.
MIRROR_REBUILD_CRASH_POINTS = (
    "mirror.rebuild.mid_fold",  # a chunk merged into <path>.rebuild, more to fold
    "mirror.rebuild.before_switch",  # the new table complete and durable, not switched
    "mirror.rebuild.after_switch",  # switched, the old table not yet removed
)
# `eventplane restore` (daemon/restore.py): a kill at any of them leaves no WAL
# in the data_dir (run refuses, a new restore starts over).
RESTORE_CRASH_POINTS = (
    "restore.mid_download",  # after an object's frames are in the temp segments
    "restore.after_takeover",  # the archive fenced at the next epoch, nothing in place
    "restore.after_watermarks",  # watermarks.json in place, the WAL not yet
)
# The WAL archive's upload (daemon/walarchive.py), in its own threads:
ARCHIVE_CRASH_POINTS = ("archive.before_put",)  # an object made, its create not sent
CRASH_POINTS = tuple(
    dict.fromkeys(
        COMMIT_CRASH_POINTS
        + RETENTION_CRASH_POINTS
        + COMPACT_CRASH_POINTS
        + REPLAY_CRASH_POINTS
        + DELTA_CRASH_POINTS
        + S3_CRASH_POINTS
        + MIRROR_CRASH_POINTS
        + MIRROR_REPLAY_CRASH_POINTS
        + COALESCE_CRASH_POINTS
        + MIRROR_REBUILD_CRASH_POINTS
        + RESTORE_CRASH_POINTS
        + ARCHIVE_CRASH_POINTS
    )
)
_crash_hits: dict[str, int] = {}
_crash_lock = threading.Lock()


def crash_point(name: str) -> None:
    """SIGKILL this process here if ``$EVENTPLANE_CRASH_AT`` names this point
    (SIGSTOP if ``$EVENTPLANE_PAUSE_AT`` does; block the thread for ever from
    then on if ``$EVENTPLANE_STALL_AT`` does).

    ``name@n`` fires at the n-th arrival, so a full-daemon test can let some
    batches commit first. Costs three environment lookups when unset.
    """
    wanted = os.environ.get(ENV_CRASH_AT)
    pause = os.environ.get(ENV_PAUSE_AT)
    stall = os.environ.get(ENV_STALL_AT)
    if not wanted and not pause and not stall:
        return
    if stall and stall.partition("@")[0] == name:
        hits, nth = _arrival(name, stall)
        if hits >= nth:  # this arrival and every later one
            os.write(2, f"eventplane: stall point {name} reached (hit {hits}); blocked\n".encode())
            while True:
                time.sleep(3600)
        return
    spec = next((w for w in (wanted, pause) if w and w.partition("@")[0] == name), None)
    if spec is None:
        return
    hits, nth = _arrival(name, spec)
    if hits != nth:
        return  # only the n-th arrival: a pause fires once, not at every later one
    if spec is not wanted:
        os.write(2, f"eventplane: pause point {name} reached (hit {hits}); SIGSTOP\n".encode())
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    # os.write: unbuffered, so the line survives the kill; tests look for it.
    os.write(2, f"eventplane: crash point {name} reached (hit {hits}); SIGKILL\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # SIGKILL is asynchronous only in theory; never run past it


def _arrival(name: str, spec: str) -> tuple[int, int]:
    """This arrival's number at ``name`` and the ``n`` of ``spec`` (``name@n``, default 1)."""
    _, _, nth = spec.partition("@")
    with _crash_lock:
        _crash_hits[name] = hits = _crash_hits.get(name, 0) + 1
    return hits, int(nth) if nth.isdigit() else 1
