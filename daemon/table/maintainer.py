"""One maintainer for a shared table: the daemon that holds its maintenance lease.

Several daemons append to a shared table (``writers = "shared"``,
daemon/table/delta.py); its maintenance (compaction, which is Delta's
OPTIMIZE, VACUUM and retention's DELETE) runs in one of them at a time: the
holder of ``<table>/_eventplane/maintainer.json``, a :class:`~daemon.table.lease.Lease`
whose body also names the daemon (its ``[daemon] name``). On S3 it is an
object beside the writers' leases (:class:`~daemon.table.lease.S3Store`,
``[s3] lease_ttl_s`` and ``lease_skew_s``); on disk a file in the table's
folder (:class:`~daemon.table.lease.LocalStore`, :data:`LOCAL_TTL_S` and
:data:`LOCAL_SKEW_S`).

- Each maintenance tick (a compaction check, a retention run) calls
  :meth:`Maintainer.tick`: the holder goes on; any other daemon tries to take
  the lease, and skips the job while another holds it (logged once per
  holder, at info; :meth:`Maintainer.status` names the holder).
- The holder renews it every ``renew_s`` in a thread of its own, so a long
  OPTIMIZE keeps it; a clean stop releases it (the next daemon's tick takes
  it at once); a daemon that dies leaves it to expire, after ``ttl_s`` plus
  ``skew_s``.
- The lease saves work, it does not fence: two maintainers at once (a
  paused holder waking past its lease) are still safe, because each
  maintenance commit goes through Delta's conflict checks and every append
  of a shared table is retried onto the commits that took its version
  (``SHARED_COMMIT_ATTEMPTS``).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import structlog

from daemon.table.lease import Lease, LeaseError, LeaseHeldError

log = structlog.get_logger("eventplane.cdc")

# The lease's key under the table's _eventplane/ folder (or prefix).
KEY = "maintainer.json"
# A table on disk: the lease's ttl and skew (the daemons share a file system,
# one host's clock or a few synced ones). A dead maintainer is replaced after
# about ttl + skew, at the next daemon's maintenance tick.
LOCAL_TTL_S = 30.0
LOCAL_SKEW_S = 5.0


class MaintainerLease(Lease):
    """A :class:`Lease` whose body also carries the holder's daemon name."""

    def __init__(self, *args: Any, name: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.name = name

    def _body(self) -> bytes:
        body = json.loads(super()._body())
        body["name"] = self.name
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    def holder_name(self) -> str | None:
        """The daemon name in the lease as stored now (None: no lease)."""
        current = self.store.get(self.key)
        if current is None:
            return None
        raw = json.loads(current[0])
        return str(raw.get("name") or raw.get("holder", {}).get("host") or "?")


class Maintainer:
    """This daemon's side of a shared table's maintenance lease (module doc)."""

    def __init__(self, lease: MaintainerLease, what: str) -> None:
        self.lease, self.what = lease, what
        self.maintainer: str | None = None  # who maintains it, as last seen
        self.error: str | None = None  # the last store error
        self.skipped = 0  # maintenance jobs skipped: another daemon's
        self._said: str | None = None  # the holder last logged
        self._lock = threading.Lock()  # one store call at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.lease.name

    def tick(self) -> bool:
        """Before a maintenance job: True when this daemon maintains the table
        (the lease renewed or taken); else False, :attr:`maintainer` naming
        the holder (a store error: False, or True while the lease lasts)."""
        with self._lock:
            try:
                if self.lease.holding:
                    if not self.lease.may_commit():
                        self.lease.renew()
                else:
                    self.lease.take()
                    self._taken()
            except LeaseHeldError:
                return self._held()
            except LeaseError as exc:  # renew: another daemon took it
                log.info("cdc_maintainer_lost", table=self.what, error=str(exc))
                return self._held()
            except Exception as exc:
                if self.error is None:
                    log.warning("cdc_maintainer_lease_error", table=self.what, error=str(exc))
                self.error = str(exc)
                return self.lease.may_commit()
            self.error = None
            self.maintainer = self.name
            return self.lease.may_commit()

    def _taken(self) -> None:
        log.info("cdc_maintainer_taken", table=self.what, maintainer=self.name)
        self._said = self.name
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._renew, name=f"maintainer {self.what}", daemon=True
            )
            self._thread.start()

    def _held(self) -> bool:
        try:
            self.maintainer = self.lease.holder_name()
        except Exception as exc:
            self.error = str(exc)
        self.skipped += 1
        if self.maintainer != self._said:
            self._said = self.maintainer
            log.info(
                "cdc_maintenance_skipped",
                table=self.what,
                maintainer=self.maintainer,
                why="another daemon maintains the shared table (compaction, VACUUM, retention)",
            )
        return False

    def _renew(self) -> None:
        while not self._stop.wait(self.lease.renew_s):
            with self._lock:
                if not self.lease.holding:
                    continue
                try:
                    self.lease.renew()
                except LeaseError as exc:
                    log.info("cdc_maintainer_lost", table=self.what, error=str(exc))
                except Exception as exc:
                    if self.error is None:
                        log.warning("cdc_maintainer_lease_error", table=self.what, error=str(exc))
                    self.error = str(exc)
                else:
                    self.error = None

    def status(self) -> dict[str, Any]:
        return {
            "maintainer": self.maintainer,
            "this_daemon": self.lease.may_commit(),
            "seconds_left": round(self.lease.seconds_left(), 1),
            "skipped": self.skipped,
            "error": self.error,
        }

    def stop(self) -> None:
        """Stop renewing and release the lease if it is this daemon's (a
        failure is logged: the lease then expires by itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease.renew_s + 5)
        try:
            with self._lock:
                if self.lease.holding:
                    self.lease.release()
                    log.info("cdc_maintainer_released", table=self.what, maintainer=self.name)
        except Exception as exc:
            log.warning("cdc_maintainer_not_released", table=self.what, error=str(exc))
