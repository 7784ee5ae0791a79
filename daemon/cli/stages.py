"""``eventplane pause STAGE [--reason TEXT]`` and ``eventplane resume STAGE``.

They call the admin API of a running daemon (``POST
/v1/stages/{name}/pause|resume``, docs/operating.md "Pausing a stage") at
``--url`` or the config's ``admin.listen``, and print the stage's new state.
The pause is recorded as being by ``user@host`` of whoever ran the command.

Exit codes, as ``eventplane status``: 0 done (also when the stage already
was paused, or running) · 1 refused (an unknown stage: the known ones are
listed; the daemon starting or draining) or an unreadable answer · 3 not
reachable (daemon not running, wrong URL). 2 stays the CLI's usage/config
code. Only the standard library is imported.
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, TextIO

from daemon.cli.access import NO_ACCESS, Access
from daemon.cli.status import (
    DEFAULT_TIMEOUT_S,
    EXIT_HEALTHY,
    EXIT_UNHEALTHY,
    EXIT_UNREACHABLE,
    STATUS_PATH,
    admin_url,
    stage_state,
)
from daemon.config import Config

EXIT_DONE = EXIT_HEALTHY
EXIT_REFUSED = EXIT_UNHEALTHY


def stage_url(cfg: Config, url: str | None, name: str, action: str) -> str:
    """``<admin base>/v1/stages/<name>/<action>`` (the name percent-encoded)."""
    base = admin_url(cfg, url).removesuffix(STATUS_PATH)
    return f"{base}/v1/stages/{urllib.parse.quote(name, safe=':')}/{action}"


def who() -> str:
    """``user@host`` of whoever runs the command, for the pause's record."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (a container)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def call(
    url: str, body: Mapping[str, Any], timeout: float, access: Access = NO_ACCESS
) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON; the status code and the JSON answer (any code)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with access.urlopen(request, timeout) as resp:
            raw: bytes = resp.read()
            code = int(resp.status)
    except urllib.error.HTTPError as exc:
        raw, code = exc.read(), exc.code
        exc.close()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ValueError(f"{url} answered HTTP {code} without a JSON object")
    return code, doc


def main(
    args: argparse.Namespace, cfg: Config, out: TextIO | None = None, access: Access = NO_ACCESS
) -> int:
    out = sys.stdout if out is None else out
    action: str = args.command  # "pause" | "resume"
    name: str = args.stage
    url = stage_url(cfg, getattr(args, "url", None), name, action)
    body: dict[str, Any] = {}
    if action == "pause":
        body["by"] = who()
        if getattr(args, "reason", None):
            body["reason"] = args.reason
    prog = f"eventplane {action}"
    try:
        code, doc = call(url, body, DEFAULT_TIMEOUT_S, access)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"{prog}: cannot reach {url}: {reason}", file=sys.stderr)
        print(
            "  Is the daemon running? `systemctl status eventplane`, and check "
            "[admin] listen in the config (or pass --url).",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if code == 404 and doc.get("error") == "unknown_stage":
        stages = ", ".join(doc.get("stages") or []) or "none"
        print(f"{prog}: no stage {name!r} in this daemon; its stages: {stages}", file=sys.stderr)
        return EXIT_REFUSED
    if code != 200:
        detail = doc.get("message") or doc.get("error") or "no message"
        print(f"{prog}: {url} answered HTTP {code}: {detail}", file=sys.stderr)
        return EXIT_REFUSED
    stage = doc.get("stage")
    stage = stage if isinstance(stage, dict) else {}
    if action == "pause":
        verb = "paused" if doc.get("changed") else "was already paused"
    else:
        verb = "resumed" if doc.get("changed") else "was not paused"
    out.write(f"stage {name} {verb}; now {stage_state(stage, time.time())}\n")
    if action == "resume" and stage.get("queued_rows"):
        out.write(
            f"  its {stage['queued_rows']:,} queued row(s) go out now, oldest first, each "
            "call under the key it was formed with\n"
        )
    if action == "resume" and stage.get("behind_batches"):
        out.write(
            f"  it re-runs the {stage['behind_batches']:,} batch(es) it missed, oldest first; "
            "`eventplane status` shows its progress\n"
        )
    return EXIT_DONE
