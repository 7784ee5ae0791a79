"""Step 1's file system: the daemon's jar ends the forked ``chmod`` processes of
a staging write; without it the write forks them as before and still commits."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import structlog

from daemon.spark import session
from daemon.table import layout, sparkio
from daemon.table.compactmerge import write_merged_spark
from daemon.table.compactplan import Plan, data_files
from tests import requires
from tests.spark.support import batch_lsns, make_batches, read_table

pytestmark = pytest.mark.spark


@pytest.fixture
def needs_jar() -> None:
    """The daemon's jar, which make builds when javac exists."""
    requires.daemon_jar(None if session.HADOOP_JAR.is_file() else f"no {session.HADOOP_JAR}")


async def chmods_during(spark: Any, tmp_path: Path, work: Callable[[], Awaitable[Any]]) -> int:
    """How many ``chmod`` processes the driver JVM started while ``work`` ran
    (JFR's ``jdk.ProcessStart`` events: every process a JVM starts, exactly)."""
    jvm = spark.sparkContext._jvm
    recording = jvm.jdk.jfr.Recording()
    recording.enable("jdk.ProcessStart")
    recording.start()
    try:
        await work()
    finally:
        recording.stop()
    dump = jvm.java.io.File(str(tmp_path / "forks.jfr")).toPath()
    recording.dump(dump)
    recording.close()
    events = jvm.jdk.jfr.consumer.RecordingFile.readAllEvents(dump)
    return sum(1 for e in events if str(e.getString("command")).split()[0].endswith("chmod"))


@pytest.fixture
def fresh_options() -> Any:
    """The per-session choice of file system is made again in the test."""
    with mock.patch.object(sparkio, "_staging_options", None):
        yield


@pytest.mark.usefixtures("needs_jar")
async def test_a_batch_forks_no_chmod_with_the_daemons_jar(
    spark: Any, executor_factory: Any, tmp_path: Path, fresh_options: Any
) -> None:
    """The test session's JVM was started by ``build_session`` with the jar on
    its class path (``spark.driver.extraClassPath``): Hadoop's configuration
    loads the class, and a batch into several collections forks nothing."""
    hadoop_conf = spark.sparkContext._jsc.hadoopConfiguration()
    assert hadoop_conf.getClassByNameOrNull(sparkio.NIO_LOCAL_FS) is not None
    assert sparkio.staging_write_options(spark)["fs.file.impl"] == sparkio.NIO_LOCAL_FS
    ex = await executor_factory()
    batches = make_batches(2, 200)
    await ex.execute(batches[0])  # the first batch of a table writes its summaries
    forks = await chmods_during(spark, tmp_path, lambda: ex.execute(batches[1]))
    assert forks == 0
    rows = read_table(spark, tmp_path / "cdc" / "all")
    assert sorted(r.lsn for r in rows) == batch_lsns(batches)
    assert len({r.collection for r in rows}) > 1


async def test_without_the_class_a_batch_forks_chmod_commits_and_says_so_once(
    spark: Any, executor_factory: Any, tmp_path: Path, fresh_options: Any
) -> None:
    """A JVM that cannot load the class (the jar was not built, or not on its
    class path) gets Hadoop's plain file system: the batch forks its ``chmod``s
    as before and commits, and the reason is logged once per process."""
    ex = await executor_factory()
    batches = make_batches(3, 200)
    missing = "eventplane.hadoop.NotBuilt"
    with (
        mock.patch.object(sparkio, "NIO_LOCAL_FS", missing),
        mock.patch.object(sparkio, "_staging_fallback_logged", False),
        structlog.testing.capture_logs() as logs,
    ):
        await ex.execute(batches[0])
        forks = await chmods_during(spark, tmp_path, lambda: ex.execute(batches[1]))
        with mock.patch.object(sparkio, "_staging_options", None):  # asked again: not logged again
            await ex.execute(batches[2])
        options = sparkio.staging_write_options(spark)
    assert options["fs.file.impl"] == "org.apache.hadoop.fs.RawLocalFileSystem"
    assert forks >= 2  # at least a file and its collection's folder
    said = [e for e in logs if e["event"] == "cdc_staging_forks_chmod"]
    assert len(said) == 1 and missing in said[0]["reason"], said
    rows = read_table(spark, tmp_path / "cdc" / "all")
    assert sorted(r.lsn for r in rows) == batch_lsns(batches)


@pytest.mark.usefixtures("needs_jar")
def test_nio_file_system_sets_the_mode_bits_chmod_would(spark: Any, tmp_path: Path) -> None:
    """Files and folders get exactly the mode asked for; a mode with the sticky
    bit (which java.nio cannot set) goes to Hadoop's own ``chmod``."""
    jvm = spark.sparkContext._jvm
    fs = jvm.eventplane.hadoop.NioLocalFileSystem()
    fs.initialize(jvm.java.net.URI("file:///"), spark.sparkContext._jsc.hadoopConfiguration())
    f, d = tmp_path / "f", tmp_path / "d"
    f.write_bytes(b"x")
    d.mkdir()
    for path, mode in ((f, "640"), (f, "400"), (f, "777"), (d, "750"), (d, "1777"), (d, "700")):
        fs.setPermission(jvm.org.apache.hadoop.fs.Path(str(path)), _perm(jvm, mode))
        assert stat.S_IMODE(os.stat(path).st_mode) == int(mode, 8), (path, mode)


def _perm(jvm: Any, mode: str) -> Any:
    return jvm.org.apache.hadoop.fs.permission.FsPermission(mode)


@pytest.mark.usefixtures("needs_jar")
async def test_compactions_spark_write_forks_no_chmod_and_writes_only_parquet(
    spark: Any, executor_factory: Any, tmp_path: Path, fresh_options: Any
) -> None:
    """A compaction's Spark write (the fallback of its pyarrow path) uses the
    staging write's file system: no ``chmod``, no ``.crc``, no ``_SUCCESS``."""
    ex = await executor_factory(stream_options={"compaction": False})
    batches = make_batches(3, 100)
    for b in batches:
        await ex.execute(b)
    folder = next((tmp_path / "cdc" / "all").glob("collection=*"))
    files = data_files(folder)
    assert len(files) == 3
    plan = Plan(folder.name, "full", [files], len(files))
    out = tmp_path / "merged"

    async def merge() -> None:
        await asyncio.to_thread(write_merged_spark, spark, folder, plan, out)

    assert await chmods_during(spark, tmp_path, merge) == 0
    written = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(written) == 1 and written[0].endswith(".parquet"), written


def test_the_jar_goes_on_a_local_drivers_class_path_after_the_users_entries(
    tmp_path: Path,
) -> None:
    """``effective_conf`` appends the jar to ``spark.driver.extraClassPath``
    (keeping the user's entries) for a local master only, and only when it was
    built: a cluster's executors or a Spark Connect server would not have it."""
    jar = tmp_path / "eventplane-hadoop.jar"
    key = "spark.driver.extraClassPath"
    with mock.patch.object(session, "HADOOP_JAR", jar):
        assert key not in session.effective_conf("local[2]", "warn", {}, ui=False)
        jar.write_bytes(b"PK")
        assert session.effective_conf("local[2]", "warn", {}, ui=False)[key] == str(jar)
        mine = {key: "/opt/a.jar"}
        got = session.effective_conf("local[*]", "warn", mine, ui=False)[key]
        assert got == f"/opt/a.jar{os.pathsep}{jar}"
        assert key not in session.effective_conf("spark://h:7077", "warn", {}, ui=False)
        remote = session.effective_conf("", "warn", {}, ui=False, remote="sc://h:15002")
        assert key not in remote


@contextmanager
def py4j_commands() -> Iterator[list[str]]:
    """Every command this process sends to the JVM while the block runs, but
    py4j's releases of garbage-collected proxies (``m``/``d``): the collector
    sends those whenever it runs, for objects of any earlier call (a suite run
    counted 69 of them inside one select)."""
    import py4j.clientserver as cs
    import py4j.java_gateway as jg
    from py4j.protocol import MEMORY_COMMAND_NAME, MEMORY_DEL_SUBCOMMAND_NAME

    release = MEMORY_COMMAND_NAME + MEMORY_DEL_SUBCOMMAND_NAME
    sent: list[str] = []
    patches = []
    for client in (cs.JavaClient, jg.GatewayClient):
        real = client.send_command

        def send(self: Any, command: str, *a: Any, _real: Any = real, **k: Any) -> Any:
            if not command.startswith(release):
                sent.append(command)
            return _real(self, command, *a, **k)

        patches.append(mock.patch.object(client, "send_command", send))
    with patches[0], patches[1]:
        yield sent


async def test_each_select_and_the_writes_options_are_one_py4j_command(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """The contract's and the write's select lists go to the JVM as one Seq,
    and step 1's writer options as one map, built once per session: a select
    is one command, not one per column, and the options one, not one each."""
    from daemon.spark import frame

    ex = await executor_factory()
    (sink,) = ex.sinks
    await ex.execute(make_batches(1, 50)[0])
    raw = spark.read.schema(frame.INBOX_SCHEMA).parquet(str(tmp_path))
    # The batch above may have come through the raw inbox, whose frame has its
    # own list (no parse_json), and been written without a job, which builds
    # no write list: this builds the Parquet inbox's list and the write's.
    sink._select(frame._contract_frame(raw))
    with py4j_commands() as contract:
        df = frame._contract_frame(raw)
    with py4j_commands() as write:
        out = sink._select(df)
    writer = out.write
    with py4j_commands() as options:
        sink._write_options(spark).set_on(writer)
    assert (len(contract), len(write), len(options)) == (1, 1, 1), (contract, write, options)
    assert out.columns == [*layout.TABLE_COLUMNS]
    assert [f.name for f in df.schema.fields] == list(frame.FRAME_COLUMNS)


@pytest.mark.usefixtures("needs_jar")
async def test_the_session_drops_hadoops_yarn_defaults_but_keeps_what_was_set(
    spark: Any, executor_factory: Any, fresh_options: Any
) -> None:
    """With the daemon's jar, the session's Hadoop configuration loses the keys
    only ``yarn-default.xml`` set (a local master reads none) and batches still
    commit; a YARN key set by a program, and every other default, stay (shown
    on a new configuration, which has every default)."""
    jvm = spark.sparkContext._jvm
    fresh = jvm.org.apache.hadoop.conf.Configuration()
    fresh.set("yarn.eventplane.test", "kept")
    before, core = fresh.size(), fresh.get("fs.defaultFS")
    dropped = jvm.eventplane.hadoop.HadoopDefaults.drop(fresh, "yarn-default.xml")
    assert dropped > 100 and fresh.size() == before - dropped  # 527 of 1,100 here
    assert (fresh.get("yarn.eventplane.test"), fresh.get("fs.defaultFS")) == ("kept", core)
    assert fresh.get("mapreduce.fileoutputcommitter.algorithm.version") is not None

    ex = await executor_factory()
    await ex.execute(make_batches(1, 50)[0])
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    sources = [conf.getPropertySources(e.getKey()) for e in conf.iterator()]
    assert not [s for s in sources if s is not None and list(s) == ["yarn-default.xml"]]


@pytest.mark.parametrize(
    ("master", "why"),
    [("spark://h:7077", "master spark://h:7077"), ("local-cluster[2,1,1024]", "local-cluster")],
)
def test_masters_whose_tasks_run_in_other_jvms_keep_hadoops_file_system(
    master: str, why: str
) -> None:
    """The jar is on the driver's class path only: where executors are other
    JVMs, or under Spark Connect (no JVM here), the write keeps Hadoop's own
    file system, before any call to the JVM."""
    jsc = mock.Mock(spec=["hadoopConfiguration"])
    classic = mock.Mock(_sc=mock.Mock(master=master, _jsc=jsc))
    reason = sparkio._nio_fs_missing(classic)
    assert reason is not None and why in reason
    jsc.hadoopConfiguration.assert_not_called()
    connect = mock.Mock(spec=["sql"])  # a Connect session has no _sc
    assert "Spark Connect" in str(sparkio._nio_fs_missing(connect))
