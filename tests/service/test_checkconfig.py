"""``eventplane check-config`` has Spark analyse every trigger, as start-up does."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon import config as configmod
from daemon.cli import checkconfig
from daemon.cli.main import main as cli_main
from tests.integration.harness import ROOT, webhook_trigger

# Valid SQL that Spark cannot analyse: an unknown column, a string compared as a boolean.
UNKNOWN_COLUMN = "nosuch > 1"
NOT_A_BOOLEAN = "new:amount::string"


def _config(tmp_path: Path, *whens: str) -> Path:
    text = "[daemon]\ncores = 2\n"
    for i, when in enumerate(whens):
        text += webhook_trigger(f"t{i}", when, "http://127.0.0.1:9/hook")
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


class SharedSession:
    """The session-scoped ``spark`` fixture, which main() must not stop."""

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        self.built = 0

    def __call__(self, cfg: configmod.Config) -> Any:
        self.built += 1
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spark, name)

    def stop(self) -> None:
        pass


@pytest.mark.spark
def test_a_when_spark_cannot_analyse_is_reported_with_the_trigger_and_exit_2(
    tmp_path: Path, spark: Any
) -> None:
    cfg = configmod.load(_config(tmp_path, "new:amount::double > 1", UNKNOWN_COLUMN, NOT_A_BOOLEAN))
    out, err = io.StringIO(), io.StringIO()
    assert checkconfig.main(cfg, out=out, err=err, session_factory=SharedSession(spark)) == 2
    text = err.getvalue()
    assert text.startswith("checking 3 trigger conditions with Spark")
    assert "triggers[1] (\"t1\").when: Spark cannot use 'nosuch > 1'" in text
    assert "UNRESOLVED_COLUMN" in text
    assert 'triggers[2] ("t2").when' in text
    assert 'triggers[0] ("t0")' not in text
    assert out.getvalue() == ""


@pytest.mark.spark
def test_triggers_spark_accepts_print_ok(tmp_path: Path, spark: Any) -> None:
    cfg = configmod.load(_config(tmp_path, "new:amount::double > 1"))
    out, err = io.StringIO(), io.StringIO()
    assert checkconfig.main(cfg, out=out, err=err, session_factory=SharedSession(spark)) == 0
    assert out.getvalue() == f"OK {cfg.source}\n"


def test_no_spark_and_no_triggers_start_no_session(tmp_path: Path) -> None:
    def no_spark(cfg: configmod.Config) -> Any:
        raise AssertionError("no session expected")

    for cfg, spark in (
        (configmod.load(_config(tmp_path, UNKNOWN_COLUMN)), False),
        (configmod.load(_config(tmp_path)), True),
    ):
        out, err = io.StringIO(), io.StringIO()
        assert checkconfig.main(cfg, spark=spark, out=out, err=err, session_factory=no_spark) == 0
        assert out.getvalue().startswith("OK ") and err.getvalue() == ""


def test_spark_that_cannot_start_exits_1_and_names_no_spark(tmp_path: Path) -> None:
    def broken(cfg: configmod.Config) -> Any:
        raise RuntimeError("Java gateway process exited before sending its port number")

    err = io.StringIO()
    cfg = configmod.load(_config(tmp_path, "new:amount::double > 1"))
    assert checkconfig.main(cfg, out=io.StringIO(), err=err, session_factory=broken) == 1
    assert "cannot start Spark" in err.getvalue() and "--no-spark" in err.getvalue()


def test_the_no_spark_flag_reaches_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path, UNKNOWN_COLUMN)
    assert cli_main(["check-config", "--no-spark", "--config", str(path)]) == 0
    assert capsys.readouterr().out == f"OK {path.resolve()}\n"


def test_analysis_takes_only_sql_settings_from_spark_conf() -> None:
    conf = {"spark.sql.ansi.enabled": "false", "spark.driver.memory": "8g"}
    assert checkconfig.check_session_conf(conf) == {"spark.sql.ansi.enabled": "false"}


@pytest.mark.spark
def test_check_config_command_starts_spark_and_rejects_a_bad_when(tmp_path: Path) -> None:
    path = _config(tmp_path, UNKNOWN_COLUMN)
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli.main", "check-config", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "checking 1 trigger condition with Spark" in proc.stderr
    assert "triggers[0] (\"t0\").when: Spark cannot use 'nosuch > 1'" in proc.stderr
