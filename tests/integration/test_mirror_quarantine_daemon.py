"""A strict mirror's quarantine against a real daemon over loopback (a
mirrors-only daemon: no JVM): health names the mirror and the command, the
gauge counts its events, and ``eventplane cdc mirror quarantine`` replays and
purges through the admin API while the daemon holds the mirror, and under the
mirror's lock once it is stopped."""

from __future__ import annotations

import io
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from daemon import config as configmod
from daemon import events
from daemon.cli import cdc as cdccmd
from daemon.cli.main import build_parser
from daemon.table import quarantine
from daemon.table.layout import META_DIR
from tests.integration.harness import DaemonProcess, write_config
from tests.integration.test_idempotent_restart import ndjson, post

COLUMNS = '{ amount = "double", n = "long" }'


def _config(tmp_path: Path) -> Path:
    extra = f"""
[[cdc.mirrors]]
name = "orders"
collection = "orders"
path = "{tmp_path / "mirror"}"
columns = {COLUMNS}
buckets = 2
strict = true
"""
    return write_config(tmp_path, cores=2, interval_ms=100, extra=extra)


def set_aside(mirror: Path, batch_id: int, *evs: tuple[int, str]) -> None:
    """Events an emit action made that the strict mirror set aside (``n``
    does not fit its long column), as its commit writes them."""
    rows = []
    for lsn, key in evs:
        event = events.StoredEvent(
            "orders", "insert", key, b'{"amount": 2, "n": 1.5}', None, time.time_ns(), depth=1,
            source="echo",
        )  # fmt: skip
        rows.append(
            quarantine.QuarantinedRow(
                lsn, 0, lsn, batch_id, "orders", "insert", key,
                'field "new.n": a number does not fit the long column', events.encode(event),
                time.time(),
            )
        )  # fmt: skip
    quarantine.write_batch(mirror / META_DIR, "orders", batch_id, rows, kind="mirror")


def mirror_rows(path: Path) -> dict[str, Any]:
    from deltalake import DeltaTable

    return {r["key"]: r for r in DeltaTable(str(path)).to_pyarrow_table().to_pylist()}


def get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=15) as r:
            body = r.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            body = exc.read().decode()
    return json.loads(body) if body.startswith("{") else body


def cli(config: Path, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    args = build_parser().parse_args(["cdc", "mirror", "quarantine", *argv])
    return cdccmd.main(args, configmod.load(config), out=out), out.getvalue()


def test_health_and_the_gauge_name_the_mirror_and_the_cli_replays_and_purges_through_it(
    tmp_path: Path,
) -> None:
    mirror = tmp_path / "mirror"
    config = _config(tmp_path)
    daemon = DaemonProcess.production(config).start()
    try:
        body = ndjson([{"collection": "orders", "op": "insert", "key": "a", "new": {"n": 1}}])
        assert post(daemon.ingest_url, body, "k1")[0] == 200
        deadline = time.monotonic() + 30
        while "a" not in mirror_rows(mirror):
            assert time.monotonic() < deadline, daemon.tail()
            time.sleep(0.1)
    finally:
        assert daemon.stop() == 0
    set_aside(mirror, 7, (1001, "c"), (1002, "d"))
    # The cause fixed (no longer strict), the daemon restarted.
    config.write_text(config.read_text().replace("strict = true", "strict = false"))
    daemon = DaemonProcess.production(config).start()
    try:
        (notice,) = get(daemon.admin_url + "/healthz")["notices"]
        assert notice["part"] == "mirror orders" and notice["quarantined"] == 2
        assert "eventplane cdc mirror quarantine list orders" in notice["message"]
        assert 'eventplane_mirror_quarantine_rows{mirror="orders"} 2.0' in get(
            daemon.admin_url + "/metrics"
        )
        code, text = cli(config, "list", "orders", "--json")
        assert code == 0 and [(r["lsn"], r["key"]) for r in json.loads(text)] == [
            (1001, "c"),
            (1002, "d"),
        ]
        code, text = cli(config, "replay", "orders", "--lsn", "1001")
        assert code == 0 and "replayed 1 row(s) of mirror 'orders'" in text, text
        assert "1 left in the quarantine" in text
        assert cli(config, "purge", "orders", "--lsn", "1002")[0] == 1  # not confirmed
        code, text = cli(config, "purge", "orders", "--lsn", "1002", "--yes")
        assert code == 0 and "purged 1 row(s) of mirror 'orders'" in text, text
        assert get(daemon.admin_url + "/healthz").get("notices", []) == []
        assert 'eventplane_mirror_quarantine_rows{mirror="orders"} 0.0' in get(
            daemon.admin_url + "/metrics"
        )
        rows = mirror_rows(mirror)
        assert (rows["c"]["lsn"], rows["c"]["amount"], rows["c"]["n"]) == (1001, 2.0, None)
        assert "d" not in rows
    finally:
        assert daemon.stop() == 0
    (entry,) = [
        json.loads(line)
        for line in (mirror / META_DIR / "quarantine" / quarantine.PURGE_LOG)
        .read_text()
        .splitlines()
    ]
    assert entry["mirror"] == "orders" and entry["lsns"] == [1002] and "@" in entry["by"]
    # Stopped: the command takes the mirror's lock and replays here.
    set_aside(mirror, 8, (1003, "e"))
    code, text = cli(config, "replay", "orders")
    assert code == 0 and "replayed 1 row(s) of mirror 'orders'" in text, text
    assert mirror_rows(mirror)["e"]["lsn"] == 1003
    code, text = cli(config, "list", "orders")
    assert code == 0 and "mirror 'orders': the quarantine is empty" in text
