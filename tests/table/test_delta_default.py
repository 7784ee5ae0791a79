"""Delta is the default format; only the Delta streams Spark writes need Delta's
jars (daemon/spark/deltajars.py), and a Parquet table under a stream that now
defaults to Delta is refused, naming the line that keeps it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from daemon.config import CdcConfig, CdcStream, Config, SparkConfig
from daemon.spark import deltajars
from daemon.table.delta import DeltaSink
from daemon.table.errors import CdcLayoutError
from daemon.table.parquet import CdcSink


def test_a_parquet_table_under_a_default_delta_stream_is_refused_naming_the_line_that_keeps_it(
    tmp_path: Path,
) -> None:
    table = tmp_path / "cdc" / "all"
    old = CdcSink(CdcStream("all", ("*",), table, format="parquet"), wal_id="w", cores=2)
    old.open()
    old.close()
    with pytest.raises(CdcLayoutError) as info:
        DeltaSink(CdcStream("all", ("*",), table), wal_id="w", cores=2).open()
    message = str(info.value)
    assert "holds a parquet table" in message
    assert 'add format = "parquet" to this [[cdc.streams]] entry' in message


def test_only_the_delta_streams_spark_writes_need_delta_jars() -> None:
    direct = CdcStream("direct", ("*",), Path("a"), format="delta")
    cases = {
        "direct": (direct, SparkConfig(), True, None),
        "parquet": (dataclasses.replace(direct, format="parquet"), SparkConfig(), False, None),
        "on_s3": (
            dataclasses.replace(direct, uri="s3://b/t"),
            SparkConfig(master="yarn"),
            True,
            None,
        ),
        "variant": (
            dataclasses.replace(direct, variant=True),
            SparkConfig(),
            True,
            "variant = true",
        ),
        "connect": (direct, SparkConfig(remote="sc://h:15002"), True, "spark.remote"),
        "cluster": (direct, SparkConfig(master="spark://h:7077"), True, "spark.master"),
        "job": (direct, SparkConfig(direct_write=False), True, "spark.direct_write = false"),
        "no_jar": (direct, SparkConfig(), False, "no daemon jar"),
    }
    for name, (stream, spark, daemon_jar, why) in cases.items():
        got = deltajars.spark_append(stream, spark, daemon_jar)
        assert (got is None) if why is None else (got is not None and got.startswith(why)), name
    from daemon.spark.session import HADOOP_JAR

    assert deltajars.DAEMON_JAR == HADOOP_JAR
    cfg = Config(
        cdc=CdcConfig(streams=(direct, dataclasses.replace(direct, name="v", variant=True)))
    )
    assert list(deltajars.needing(cfg, True)) == ["v"]


def test_the_jars_are_fetched_only_for_a_config_that_needs_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m daemon.spark.deltajars --config PATH`` (``make run``)."""
    fetched: list[Path] = []
    monkeypatch.setattr(deltajars, "missing", lambda folder=None: list(deltajars.ARTIFACTS))
    monkeypatch.setattr(deltajars, "fetch", lambda folder=None: fetched.append(tmp_path))
    plain = tmp_path / "plain.toml"
    plain.write_text('[[cdc.streams]]\nname = "all"\ncollections = "*"\npath = "t"\n')
    assert deltajars.main(["--config", str(plain)]) == 0
    assert fetched == []
    wide = tmp_path / "wide.toml"
    wide.write_text(plain.read_text() + 'format = "delta"\nvariant = true\n')
    assert deltajars.main(["--config", str(wide)]) == 0
    assert fetched == [tmp_path]
