"""The daemon's Spark conf: its JVM defaults, composed with the user's ``[spark.conf]``."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon.spark import session
from tests import requires

LOG4J = Path("/tmp/log4j2.properties")


def _opts(conf: dict[str, str], master: str = "local[*]") -> list[str]:
    out = session.effective_conf(master, "warn", conf, ui=False)
    return shlex.split(out["spark.driver.extraJavaOptions"])


def test_the_driver_starts_with_the_log4j_file_and_the_daemons_jvm_defaults() -> None:
    opts = _opts({})
    assert opts[0].startswith("-Dlog4j2.configurationFile=file:")
    assert opts[1:] == list(session._JVM_DEFAULTS)


def test_the_users_java_options_come_last_and_replace_the_defaults_they_set() -> None:
    defaults = ("-XX:+UseParallelGC", "-XX:TieredStopAtLevel=1", "-Dfoo=1", "-Xss4m")
    with mock.patch.object(session, "_JVM_DEFAULTS", defaults):
        # Another collector replaces ours (two would stop the JVM from starting);
        # the same flag with another value, a -D key and a -X size replace ours.
        user = "-XX:+UseG1GC -XX:TieredStopAtLevel=4 -Dfoo=2 -Xss8m -XX:+PrintFlagsFinal"
        opts = _opts({"spark.driver.extraJavaOptions": user})
        assert opts[0].startswith("-Dlog4j2.configurationFile=file:")
        assert opts[1:] == shlex.split(user)
        # Options that set something else keep ours, the user's after them.
        opts = _opts({"spark.driver.extraJavaOptions": "-Dbar=1"})
        assert opts[1:] == [*defaults, "-Dbar=1"]
        # The user's own log4j file replaces the daemon's.
        opts = _opts({"spark.driver.extraJavaOptions": "-Dlog4j2.configurationFile=x"})
        assert opts == [*defaults, "-Dlog4j2.configurationFile=x"]


def test_spark_connect_gets_no_jvm_options() -> None:
    out = session.effective_conf("", "warn", {}, ui=False, remote="sc://h:15002")
    assert "spark.driver.extraJavaOptions" not in out
    conf = {"spark.driver.extraJavaOptions": "-Dx=1"}
    out = session.effective_conf("", "warn", conf, ui=False, remote="sc://h:15002")
    assert out["spark.driver.extraJavaOptions"] == "-Dx=1"  # passed as given


def test_other_user_keys_still_win_over_the_daemons_defaults() -> None:
    conf = {"spark.sql.maxConcurrentOutputFileWriters": "4", "spark.sql.session.timeZone": "CET"}
    out = session.effective_conf("local[*]", "warn", conf, ui=False)
    assert out["spark.sql.maxConcurrentOutputFileWriters"] == "4"
    assert out["spark.sql.session.timeZone"] == "CET"


def test_delta_adds_its_jars_extension_and_catalog_and_keeps_the_users_own(
    tmp_path: Path,
) -> None:
    from daemon.spark import deltajars

    plain = session.effective_conf("local[2]", "warn", {}, ui=False)
    assert "spark.sql.extensions" not in plain
    conf = {"spark.sql.extensions": "my.Ext"}
    fetched = mock.patch.object(deltajars, "missing", return_value=[])
    with fetched:
        local = session.effective_conf("local[2]", "warn", conf, ui=False, delta=True)
        cluster = session.effective_conf("spark://h:7077", "warn", conf, ui=False, delta=True)
    assert local["spark.sql.extensions"] == f"my.Ext,{deltajars.EXTENSION}"
    assert local["spark.sql.catalog.spark_catalog"] == deltajars.CATALOG
    jars = [str(p) for p in deltajars.jars()]
    assert local["spark.driver.extraClassPath"].split(":")[-2:] == jars
    assert cluster["spark.jars"].split(",") == jars
    resolved = {"spark.jars.packages": deltajars.PACKAGE}
    out = session.effective_conf("local[2]", "warn", resolved, ui=False, delta=True)
    assert not any(j in out.get("spark.driver.extraClassPath", "") for j in jars)


@pytest.mark.spark
def test_the_running_driver_jvm_has_the_daemons_jvm_defaults(spark: Any) -> None:
    jvm = spark.sparkContext._jvm
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert any(a.startswith("-Dlog4j2.configurationFile=file:") for a in args)
    for option in session._JVM_DEFAULTS:
        assert option in args


# -- class data sharing ----------------------------------------------------------


def _java() -> str:
    return requires.command("java", "Debian package `openjdk-17-jre-headless`")


def _jvm_writes_archive(java: str, archive: Path, classpath: Path) -> None:
    """A real JVM records a (small) dynamic archive at its exit, as the driver does."""
    subprocess.run(
        [java, f"-XX:ArchiveClassesAtExit={archive}", "-Xlog:cds*=off", "-cp", str(classpath),
         "-version"],
        capture_output=True, check=True, timeout=120,
    )  # fmt: skip


def test_class_sharing_records_an_archive_first_then_checks_and_maps_it(tmp_path: Path) -> None:
    """1. No archive: the JVM records one at its exit.  2. The recorded one maps
    with that JVM: it becomes the archive and is used.  3. Then it is used as is."""
    java = _java()
    folder = tmp_path / "spark-cds"
    first = session.class_sharing(folder)
    assert first.recording and first.options[0] == f"-XX:ArchiveClassesAtExit={first.pending}"
    first.jvm_file.write_text(json.dumps({"java": java, "classpath": str(tmp_path)}))
    _jvm_writes_archive(java, first.pending, tmp_path)

    second = session.class_sharing(folder)
    assert not second.recording
    assert second.options[0] == f"-XX:SharedArchiveFile={second.archive}"
    assert second.archive.is_file() and not second.pending.exists()
    assert session.class_sharing(folder).options == second.options


def test_a_cut_pending_archive_is_removed_and_recorded_again(tmp_path: Path) -> None:
    """A JVM killed while it wrote its archive leaves a cut file: it must not be used."""
    java = _java()
    folder = tmp_path / "spark-cds"
    first = session.class_sharing(folder)
    first.jvm_file.write_text(json.dumps({"java": java, "classpath": str(tmp_path)}))
    _jvm_writes_archive(java, first.pending, tmp_path)
    data = first.pending.read_bytes()
    first.pending.chmod(0o644)
    first.pending.write_bytes(data[: len(data) // 3])

    again = session.class_sharing(folder)
    assert again.recording and not again.archive.exists() and not again.pending.exists()
    assert list(folder.glob("hs_err*")) == [] and list(Path.cwd().glob("hs_err*")) == []


def test_the_users_share_options_turn_the_daemons_class_sharing_off(tmp_path: Path) -> None:
    """``-Xshare:off`` (or an archive of the user's) in [spark.conf] wins; Spark
    Connect starts no JVM here."""
    folder = tmp_path / "spark-cds"
    assert session.driver_class_sharing(folder, "", "-Dx=1 -Xshare:off") is None
    assert session.driver_class_sharing(folder, "", "-XX:SharedArchiveFile=/a.jsa") is None
    assert session.driver_class_sharing(folder, "sc://h:15002", "") is None
    assert session.driver_class_sharing(None, "", "") is None
    assert not folder.exists()
    sharing = session.driver_class_sharing(folder, "", "-Dx=1")
    assert sharing is not None and sharing.recording


def test_a_folder_that_cannot_be_made_gives_no_class_sharing_options(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert session.class_sharing(tmp_path / "file" / "spark-cds").options == ()


@pytest.mark.spark
def test_the_driver_jvm_records_its_class_path_for_the_archive_check(
    spark: Any, tmp_path: Path
) -> None:
    sharing = session.class_sharing(tmp_path / "spark-cds")
    sharing.remember_jvm(spark)
    doc = json.loads(sharing.jvm_file.read_text())
    assert Path(doc["java"]).is_file()
    assert "spark-core" in doc["classpath"]


def test_an_archive_is_kept_per_jvm_options_and_other_ones_are_removed(tmp_path: Path) -> None:
    folder = tmp_path / "spark-cds"
    small = session.class_sharing(folder, "1g")
    big = session.class_sharing(folder, "8g")
    assert small.archive != big.archive
    big.archive.write_bytes(b"an archive")
    (folder / "spark-0123456789abcdef.jsa").write_bytes(b"of an older PySpark")
    again = session.class_sharing(folder, "8g")
    assert again.options[0] == f"-XX:SharedArchiveFile={big.archive}"
    assert sorted(p.name for p in folder.iterdir()) == [big.archive.name]
