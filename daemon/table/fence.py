"""The fence of a Delta table on S3 in its own log (invariant 18).

A writer of a table on S3 (a CDC stream, daemon/table/delta.py; a mirror,
daemon/table/mirror.py) names itself in each commit's commitInfo
(``WRITER_KEY``) and commits with no automatic retry, so an entry lands at
the version after the one it read, or fails:

1. **Fence.** A takeover's first act (:meth:`Fence.commit`): one commit of its
   own whose ``metaData`` sets ``eventplane.writer`` (its epoch and writer
   id), whose ``txn`` ``<app id>/fence`` is the epoch and whose commitInfo
   names the holder. A stale writer's next commit loses its version to it, and
   a maintenance commit rebased onto it conflicts with its ``metaData``.
2. **Check.** Before each commit (:meth:`Fence.check`): every commit since the
   last checked version is this writer's; another's means the table was taken
   over (:meth:`Fence.taken_over`): the writer stops for good. In a shared
   table (``name``, the daemon's) only the commits of that name count: the
   other daemons' are theirs to make; one of this name by another process is
   a takeover (a standby of the same WAL). One exception: a writer that found
   no table at its open (so it fenced nothing) and then finds only another's
   table creation, no data, fences it then.

docs/cdc.md, "Tables on S3", says what a user sees.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any, NoReturn

import structlog

from daemon.table.deltacommit import NAME_KEY, WRITER_KEY
from daemon.table.lease import Keeper, TableTakenOverError
from daemon.table.location import TableFiles

log = structlog.get_logger("eventplane.fence")

# The table property a fencing commit sets (its metaData action is what makes
# a stale writer's rebased commit conflict), and the txn app id, under the
# writer's, of the fences.
FENCE_PROPERTY = "eventplane.writer"
FENCE_APP = "/fence"
# Attempts of a fencing commit to a shared table, whose other daemons'
# fences and joins are metaData commits too (daemon/table/delta.py's bound).
SHARED_FENCE_ATTEMPTS = 32


def log_commits(files: TableFiles, after: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(version, actions)`` of each commit file of the table above version
    ``after``, in order; ``actions`` maps an action's kind (``txn``,
    ``commitInfo``, ``metaData``) to its first occurrence (``txn``: all)."""
    for version in files.log_versions(after):
        actions: dict[str, Any] = {}
        for line in files.read_log(version).decode("utf-8").splitlines():
            if not line.strip():
                continue
            for kind, body in json.loads(line).items():
                if kind == "txn":
                    actions.setdefault("txn", []).append(body)
                else:
                    actions.setdefault(kind, body)
        yield version, actions


class Fence:
    """One writer's side of the fence of the table in ``files`` (module doc).
    ``what`` names the table in errors (``stream 'orders' (s3://...)``);
    ``event`` prefixes the log events (``cdc`` or ``mirror``), ``fields``
    are bound to them."""

    def __init__(
        self, files: TableFiles, app_id: str, what: str, event: str, name: str = "", **fields: Any
    ):
        self.files, self.app_id, self.what = files, app_id, what
        self.name = name  # the daemon's name in a shared table ("": one writer)
        self.event, self.fields = event, fields
        self.keeper: Keeper | None = None  # set once the lease is taken
        # This process's identity in each commit's commitInfo, and the last
        # version whose commits since the fence are known to be its own.
        self.writer = uuid.uuid4().hex
        self.seen = -1

    def properties(self, **options: Any) -> Any:
        """A commit's ``CommitProperties``: this writer in commitInfo, and
        ``options`` (``max_commit_retries``, ``app_transactions``, ...);
        ``custom_metadata`` is merged."""
        from deltalake import CommitProperties

        custom = {**options.pop("custom_metadata", {}), WRITER_KEY: self.writer}
        if self.name:
            custom[NAME_KEY] = self.name
        return CommitProperties(custom_metadata=custom, **options)

    def commit(self, table: Any) -> int:
        """Step 1 on the delta-rs table ``table`` (which exists): the fencing
        commit; returns its epoch. In a shared table another daemon's
        ``metaData`` commit (its own fence) can take the version: read again
        and retry, at most ``SHARED_FENCE_ATTEMPTS`` times."""
        from deltalake.exceptions import CommitFailedError

        attempts = SHARED_FENCE_ATTEMPTS if self.name else 1
        for attempt in range(1, attempts + 1):
            try:
                return self._commit(table)
            except CommitFailedError as exc:
                if attempt == attempts:
                    raise
                log.info(f"{self.event}_fence_conflict", **self.fields, error=str(exc))
        raise AssertionError("unreachable")

    def _commit(self, table: Any) -> int:
        from deltalake import Transaction

        table.update_incremental()
        epoch = int(table.transaction_version(self.app_id + FENCE_APP) or 0) + 1
        holder = str(self.keeper.lease.holder) if self.keeper is not None else ""
        meta = {"eventplane": {"fence": epoch, "holder": holder}}
        key = f"{FENCE_PROPERTY}.{self.name}" if self.name else FENCE_PROPERTY
        table.alter.set_table_properties(
            {key: f"{epoch} {self.writer}"},
            False,
            commit_properties=self.properties(
                custom_metadata={"userMetadata": json.dumps(meta, separators=(",", ":"))},
                app_transactions=[
                    Transaction(self.app_id + FENCE_APP, epoch, int(time.time() * 1000))
                ],
            ),
        )
        self.seen = int(table.version())
        log.info(f"{self.event}_table_fenced", **self.fields, epoch=epoch, version=self.seen)
        return epoch

    def check(self, table: Any, *, advance: bool = True) -> None:
        """Step 2: the commits after the last checked version, up to the
        version ``table`` read, are all this writer's; else
        :meth:`taken_over`. ``advance``: they count as checked from now."""
        upto = int(table.version())
        for version, actions in log_commits(self.files, self.seen):
            if version > upto:
                break
            info = actions.get("commitInfo", {})
            if self.name and info.get(NAME_KEY) != self.name:
                continue  # another daemon's commit to the shared table
            if info.get(WRITER_KEY) == self.writer:
                continue
            if self.seen < 0 and "add" not in actions and "metaData" in actions:
                # No table at this writer's open, so no fence then; another
                # process of this WAL created it since (a paused writer's create
                # landing after a takeover): empty, so fence it now, as at an open.
                log.warning(f"{self.event}_table_fenced_late", **self.fields, version=version)
                self.commit(table)
                return
            self.taken_over(version, info)
        if advance:
            self.seen = max(self.seen, upto)

    def taken_over(self, version: int, info: dict[str, Any]) -> NoReturn:
        """Stop committing for good, say so in status and health (the lease's
        ``taken_over``, the batch's error), leave the table alone."""
        meta = json.loads(info.get("userMetadata") or "{}")
        by = meta.get("eventplane", {}).get("holder") if isinstance(meta, dict) else None
        by = by or info.get(WRITER_KEY) or "a writer that is not this eventplane"
        why = (
            f"another writer took the table over (Delta version {version}, "
            f"{info.get('operation', 'a commit')}, by {by}): this daemon stops committing to "
            f"it and leaves it alone; restart it to take the table back once that writer is gone"
        )
        if self.keeper is not None:
            self.keeper.surrender(why)
        log.error(f"{self.event}_table_taken_over", **self.fields, version=version, by=by)
        raise TableTakenOverError(f"{self.what}: {why}")
