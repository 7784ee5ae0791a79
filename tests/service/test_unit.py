"""systemd/eventplane.service: accepted by systemd itself, and says what the daemon needs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.config import DaemonConfig
from tests import requires

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "eventplane.service"
ENV_EXAMPLE = ROOT / "systemd" / "eventplane.env.example"
SYSUSERS = ROOT / "systemd" / "eventplane.sysusers"
# The command prefixes systemd allows before an Exec path (systemd.service(5)).
_EXEC_PREFIX = re.compile(r"^[-@:+!]*")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value in order (keys may repeat in unit files)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"assignment outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {raw!r}"
        current.setdefault(key, []).append(value)
    return sections


def seconds(span: str) -> float:
    """A systemd time span as used in this unit: "30", "30s", "10min", "5min 20s"."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span):
        total += float(number) * units[unit]
    return total


@pytest.fixture(scope="module")
def unit() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def _one(unit: dict[str, list[str]], key: str) -> str:
    values = unit.get(key)
    assert values, f"{key}= missing from the unit"
    return values[-1]


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """1. Copy the unit, pointing Exec paths that do not exist on this machine at
       real executables (verify checks they exist): ExecStart at this venv's
       console script.
    2. `systemd-analyze verify` must exit 0 and print nothing about the unit —
       unknown keys and bad values are only warnings there, so both count."""
    analyze = requires.command("systemd-analyze", "Debian package `systemd` (.ci/run installs it)")
    script = Path(sys.executable).parent / "eventplane"
    if not os.access(script, os.X_OK):
        script = tmp_path / "eventplane"
        script.write_text("#!/bin/sh\nexit 0\n")
        script.chmod(0o755)
    lines = []
    for line in UNIT.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.startswith("Exec"):
            prefix = _EXEC_PREFIX.match(value)
            head = value[prefix.end() if prefix else 0 :]
            exe, _, rest = head.partition(" ")
            if key == "ExecStart":
                exe = str(script)
            elif not os.access(exe, os.X_OK):
                exe = shutil.which(Path(exe).name) or str(script)
            line = f"{key}={value[: len(value) - len(head)]}{exe} {rest}".rstrip()
        lines.append(line)
    copy = tmp_path / UNIT.name
    copy.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=120, check=False
    )
    ours = [x for x in (proc.stdout + proc.stderr).splitlines() if UNIT.name in x]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ours == []


def test_notify_type_with_watchdog_and_main_process_access(unit: dict[str, list[str]]) -> None:
    assert _one(unit, "Type") == "notify"
    assert _one(unit, "NotifyAccess") == "main"
    watchdog = seconds(_one(unit, "WatchdogSec"))
    # The loop pings every WatchdogSec/2; below 10 s a long GC pause could kill a healthy daemon.
    assert watchdog >= 10
    assert _one(unit, "Restart") == "on-failure"


def test_stop_timeout_leaves_room_above_the_shutdown_budget(unit: dict[str, list[str]]) -> None:
    budget = DaemonConfig().shutdown_timeout_s
    # A few seconds above the budget for the final fsync, Spark's stop and process exit.
    assert seconds(_one(unit, "TimeoutStopSec")) >= budget + 5
    config_toml = (ROOT / "config.toml").read_text()
    assert re.search(r"shutdown_timeout_s = 20\.0", config_toml)


def test_sigterm_reaches_the_daemon_before_the_jvm(unit: dict[str, list[str]]) -> None:
    # control-group (the default) would SIGTERM the Spark JVM mid-batch.
    assert _one(unit, "KillMode") == "mixed"
    assert _one(unit, "KillSignal") == "SIGTERM"


def test_reload_sends_sighup_to_the_main_process(unit: dict[str, list[str]]) -> None:
    assert _one(unit, "ExecReload").split()[-2:] == ["-HUP", "$MAINPID"]


def test_runs_the_venv_console_script_as_a_dedicated_user(unit: dict[str, list[str]]) -> None:
    assert _one(unit, "ExecStart").split() == ["/opt/eventplane/venv/bin/eventplane", "run"]
    assert _one(unit, "User") == "eventplane" and _one(unit, "Group") == "eventplane"
    assert any(v.startswith("-/etc/eventplane/") for v in unit["EnvironmentFile"])
    assert "EVENTPLANE_CONFIG=/etc/eventplane/config.toml" in unit["Environment"]


def test_hardening_with_a_writable_data_dir(unit: dict[str, list[str]]) -> None:
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "CapabilityBoundingSet": "",
    }
    for key, value in expected.items():
        assert _one(unit, key) == value, key
    assert set(_one(unit, "RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    data_dir = "/var/lib/" + _one(unit, "StateDirectory")
    assert data_dir in _one(unit, "ReadWritePaths").split()
    assert _one(unit, "WorkingDirectory") == data_dir


def test_the_jvm_keeps_writable_executable_memory(unit: dict[str, list[str]]) -> None:
    # The JIT maps W+X pages; MemoryDenyWriteExecute=yes would kill the JVM on start.
    assert unit.get("MemoryDenyWriteExecute", ["no"])[-1] in ("no", "false", "0")


def test_env_example_is_plain_assignments_for_the_same_venv(unit: dict[str, list[str]]) -> None:
    venv_bin = Path(_one(unit, "ExecStart").split()[0]).parent
    assignments = {}
    for raw in ENV_EXAMPLE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), raw
        assert not line.startswith("export "), raw
        assignments[key] = value
    assert assignments["PYSPARK_PYTHON"] == str(venv_bin / "python")


def test_sysusers_creates_the_units_user(tmp_path: Path, unit: dict[str, list[str]]) -> None:
    sysusers = requires.command("systemd-sysusers", "Debian package `systemd`")
    proc = subprocess.run(
        [sysusers, "--dry-run", f"--root={tmp_path}", str(SYSUSERS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"Creating user '{_one(unit, 'User')}'" in proc.stdout + proc.stderr
    assert "ignoring" not in proc.stdout + proc.stderr


CREDENTIALS = ROOT / "systemd" / "eventplane-credentials.conf"


def test_credentials_dropin_loads_every_secret_the_config_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each LoadCredential= copies a root-only file under /etc/eventplane/credentials,
    and the config the drop-in shows names exactly those copies; that config is
    valid with $CREDENTIALS_DIRECTORY pointing at them."""
    from daemon.config import parse

    loaded = parse_unit(CREDENTIALS.read_text())["Service"]["LoadCredential"]
    names = {}
    for value in loaded:
        name, _, source = value.partition(":")
        assert source == f"/etc/eventplane/credentials/{name}"
        names[name] = source
    shown = "\n".join(
        line.removeprefix("#").strip()
        for line in CREDENTIALS.read_text().splitlines()
        if re.match(r"#   (\[|\w+ = )", line)
    )
    referenced = re.findall(r"\$\{CREDENTIALS_DIRECTORY\}/([\w.]+)", shown)
    assert sorted(referenced) == sorted(names)

    import tomllib

    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    cfg = parse(tomllib.loads(shown))
    assert cfg.ingest.tls.key == tmp_path / "ingest.key"
    assert cfg.ingest.tokens_file == tmp_path / "tokens.toml"
    assert cfg.admin.tls.cert == tmp_path / "admin.crt"
