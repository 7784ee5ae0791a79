"""Config: validated whole, every error with its key path, frozen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from daemon import config
from daemon.cli.main import main as cli_main
from daemon.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_default_config_file_loads_with_documented_defaults() -> None:
    cfg = config.load(ROOT / "config.toml")
    assert cfg.daemon.cores == 4
    assert cfg.wal.fsync == "always"
    assert cfg.ingest.listen == config.Listen("127.0.0.1", 8470)
    assert cfg.admin.listen == config.Listen("127.0.0.1", 9470)
    assert cfg.data_dir == ROOT / "var"
    assert [s.name for s in cfg.cdc.streams] == ["all"]


def test_every_error_is_reported_with_its_key_path() -> None:
    raw = {
        "wal": {"segment_bytes": "big", "fsync": "sometimes"},
        "ingest": {"listen": "8470", "surprise": 1},
        "bogus": {},
    }
    with pytest.raises(ConfigError) as info:
        config.parse(raw)
    errors = info.value.errors
    assert 'wal.segment_bytes: expected an integer >= 1 MiB and <= 1073741824, got "big"' in errors
    assert any(e.startswith("wal.fsync: expected one of") for e in errors)
    assert any(e.startswith('ingest.listen: expected "host:port"') for e in errors)
    assert any(e.startswith("ingest.surprise: unknown key") for e in errors)
    assert any(e.startswith("bogus: unknown section") for e in errors)
    assert len(errors) == 5


def test_booleans_are_not_accepted_as_integers() -> None:
    with pytest.raises(ConfigError, match=r"daemon.cores: expected an integer >= 1"):
        config.parse({"daemon": {"cores": True}})


def test_trigger_problems_name_the_trigger_index_and_key() -> None:
    raw = {
        "triggers": [
            {"name": "a", "collection": "o", "action": {"type": "webhook", "url": "http://x"}},
            {"name": "a", "collection": "o", "action": {"type": "webhook", "url": "http://x"}},
            {"name": "b", "collection": "o", "action": {"type": "telegram"}},
            {"name": "c", "collection": "o", "action": {"type": "python", "function": "nope"}},
        ]
    }
    with pytest.raises(ConfigError) as info:
        config.parse(raw)
    assert info.value.errors == [
        'triggers[1].name: duplicate trigger name "a" (also triggers[0])',
        'triggers[2].action.type: unknown action type "telegram" '
        "(expected webhook | python | emit | sql)",
        'triggers[3].action.function: expected "package.module:function", got "nope"',
    ]


def test_config_is_frozen() -> None:
    cfg = config.parse({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.daemon.cores = 8  # type: ignore[misc]


def test_relative_paths_resolve_against_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[daemon]\ndata_dir = "data"\n[[cdc.streams]]\nname = "s"\n'
        'collections = ["orders"]\npath = "out/s"\n'
    )
    cfg = config.load(path)
    assert cfg.data_dir == tmp_path / "data"
    assert cfg.cdc.streams[0].path == tmp_path / "out" / "s"
    assert cfg.cdc.streams[0].wants("orders") and not cfg.cdc.streams[0].wants("users")


def test_check_config_prints_ok_or_every_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[daemon]\ncores = 2\n")
    assert cli_main(["check-config", "--config", str(good)]) == 0
    assert capsys.readouterr().out.startswith("OK ")

    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\ncores = 0\n[wal]\nfsync = "maybe"\n')
    assert cli_main(["check-config", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "daemon.cores: expected an integer >= 1 and <= 256, got 0" in err
    assert 'wal.fsync: expected one of "always" | "interval" | "never", got "maybe"' in err


def test_unparseable_toml_says_where(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[daemon\n")
    with pytest.raises(ConfigError, match=r"not valid TOML .*line 1"):
        config.load(path)


def test_ingest_buffer_smaller_than_one_body_is_rejected_with_both_limits() -> None:
    raw = {"ingest": {"max_body_bytes": 4 * 1024 * 1024, "max_buffered_bytes": 1024 * 1024}}
    with pytest.raises(ConfigError) as info:
        config.parse(raw)
    assert info.value.errors == [
        "ingest.max_buffered_bytes: must be >= ingest.max_body_bytes (4194304), or a body "
        "of the maximum size could never be read"
    ]


def test_max_json_depth_defaults_to_128_and_stops_at_512_saying_why() -> None:
    assert config.load(ROOT / "config.toml").ingest.max_json_depth == 128
    assert config.parse({"ingest": {"max_json_depth": 512}}).ingest.max_json_depth == 512
    with pytest.raises(ConfigError) as info:
        config.parse({"ingest": {"max_json_depth": 513}})
    assert info.value.errors == [
        "ingest.max_json_depth: expected an integer >= 1 and <= 512 (deeper JSON nears the "
        "JSON decoder's recursion limit, about 1000 levels), got 513"
    ]
    with pytest.raises(ConfigError, match=r"ingest.max_json_depth: expected an integer >= 1"):
        config.parse({"ingest": {"max_json_depth": 0}})


def test_max_event_bytes_stops_at_the_writers_longest_string() -> None:
    raw = {"ingest": {"max_body_bytes": 64 << 20, "max_buffered_bytes": 64 << 20}}
    ok = {"ingest": {**raw["ingest"], "max_event_bytes": 20_000_000}}
    assert config.parse(ok).ingest.max_event_bytes == 20_000_000
    with pytest.raises(ConfigError) as info:
        config.parse({"ingest": {**raw["ingest"], "max_event_bytes": 20_000_001}})
    assert info.value.errors == [
        "ingest.max_event_bytes: expected an integer >= 64 and <= 20000000 (the CDC writers "
        "refuse a JSON string longer than 20,000,000 characters), got 20000001"
    ]


@pytest.mark.parametrize("value", ["false", "FALSE", " False ", False, "no"])
def test_a_spark_conf_that_turns_duplicate_keys_off_is_refused_saying_why(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        config.parse({"spark": {"conf": {"spark.sql.variant.allowDuplicateKeys": value}}})
    [error] = info.value.errors
    assert error.startswith("spark.conf.spark.sql.variant.allowDuplicateKeys: must stay true")
    assert "the CDC writers refuse it, so one such event would fail every batch" in error


def test_a_spark_conf_that_keeps_duplicate_keys_on_is_accepted() -> None:
    conf = {"spark.sql.variant.allowDuplicateKeys": "true"}
    assert config.parse({"spark": {"conf": conf}}).spark.conf == conf


def test_build_max_bytes_is_a_checked_microbatch_key() -> None:
    assert config.load(ROOT / "config.toml").microbatch.build_max_bytes == 16 * 1024 * 1024
    with pytest.raises(ConfigError) as info:
        config.parse({"microbatch": {"build_max_bytes": 1024}})
    assert info.value.errors == [
        "microbatch.build_max_bytes: expected an integer >= 65536, got 1024"
    ]


def test_spark_warmup_rows_class_sharing_and_direct_write_are_checked_keys_with_defaults() -> None:
    assert config.load(ROOT / "config.toml").spark.warmup_rows == 20_000
    assert config.load(ROOT / "config.toml").spark.class_sharing is False
    assert config.load(ROOT / "config.toml").spark.direct_write is True
    assert config.parse({}).spark.direct_write is True
    assert config.parse({"spark": {"direct_write": False}}).spark.direct_write is False
    with pytest.raises(ConfigError) as info:
        config.parse({"spark": {"direct_write": 1}})
    assert info.value.errors == ["spark.direct_write: expected true or false, got 1"]
    with pytest.raises(ConfigError) as info:
        config.parse({"spark": {"class_sharing": "yes"}})
    assert info.value.errors == ['spark.class_sharing: expected true or false, got "yes"']
    assert config.parse({"spark": {"warmup_rows": 0}}).spark.warmup_rows == 0
    with pytest.raises(ConfigError) as info:
        config.parse({"spark": {"warmup_rows": -1}})
    assert info.value.errors == [
        "spark.warmup_rows: expected an integer >= 0 and <= 1000000, got -1"
    ]


def _stream(**extra: object) -> dict[str, object]:
    return {"cdc": {"streams": [{"name": "s", "collections": "*", "path": "x", **extra}]}}


def test_stream_partition_by_and_retention_parse_with_defaults() -> None:
    plain = config.parse(_stream()).cdc.streams[0]
    assert plain.partition_by == ("collection",)
    assert plain.retention_s is None and plain.retention_check_s == 300.0
    s = config.parse(
        _stream(partition_by=["collection", "date", "hour"], retention="12h", retention_check_s=60)
    ).cdc.streams[0]
    assert s.partition_by == ("collection", "date", "hour")
    assert s.retention_s == 12 * 3600 and s.retention_check_s == 60.0
    assert (
        config.parse(_stream(partition_by=["collection", "date"], retention="30d"))
        .cdc.streams[0]
        .retention_s
        == 30 * 86400
    )


def test_retention_without_a_time_partition_is_refused_saying_why() -> None:
    with pytest.raises(ConfigError) as info:
        config.parse(_stream(retention="30d"))
    (error,) = info.value.errors
    assert error.startswith("cdc.streams[0].retention: needs a time partition")
    assert 'partition_by = ["collection", "date"]' in error


def test_stream_format_defaults_to_delta_and_delta_keys_need_delta() -> None:
    plain = config.parse(_stream()).cdc.streams[0]
    assert (plain.format, plain.variant, plain.vacuum_retain_hours) == ("delta", False, 168.0)
    delta = config.parse(_stream(variant=True, vacuum_retain_hours=2)).cdc.streams[0]
    assert (delta.format, delta.variant, delta.vacuum_retain_hours) == ("delta", True, 2.0)
    assert config.load(ROOT / "config.toml").cdc.streams[0].format == "delta"
    with pytest.raises(ConfigError) as info:
        config.parse(_stream(format="parquet", variant=True))
    assert info.value.errors == [
        'cdc.streams[0].variant: applies to Delta tables only; set format = "delta" or '
        "remove it (a Parquet table always has VARIANT columns)"
    ]
    with pytest.raises(ConfigError) as info:
        config.parse(_stream(format="iceberg"))
    assert info.value.errors[0].startswith("cdc.streams[0].format: expected one of")


def test_a_delta_stream_without_delta_jars_names_the_artifact_and_the_fix(
    tmp_path: Path,
) -> None:
    from daemon.spark import deltajars

    jars = tmp_path / "jars"
    why = deltajars.missing_message(deltajars.missing(jars), jars)
    assert why.startswith(f"Delta Lake's jar {deltajars.PACKAGE} is not in {jars}")
    assert "make delta-jars" in why and "spark.jars.packages" in why
    assert deltajars.unavailable(False, {}, "") is None
    assert deltajars.unavailable(True, {"spark.jars.packages": deltajars.PACKAGE}, "") is None
    assert deltajars.unavailable(True, {}, "sc://localhost:15002") is None


def test_bad_partition_by_and_retention_values_name_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        config.parse(_stream(partition_by=["date", "collection"], retention="90m"))
    errors = info.value.errors
    assert any(e.startswith("cdc.streams[0].partition_by: expected one of") for e in errors)
    assert any(
        e.startswith('cdc.streams[0].retention: expected a duration like "30d"') for e in errors
    )


def test_cdc_stream_compaction_keys_have_defaults_and_are_checked(tmp_path: Path) -> None:
    stream = {"name": "s", "collections": "*", "path": "out"}
    cfg = config.parse({"cdc": {"streams": [stream]}}, tmp_path / "c.toml")
    s = cfg.cdc.streams[0]
    assert (s.compaction, s.target_file_bytes, s.compact_min_files, s.compact_interval_s) == (
        True,
        128 * 1024 * 1024,
        16,
        60.0,
    )
    tuned = {**stream, "compaction": False, "target_file_bytes": 1 << 20, "compact_min_files": 4}
    cfg = config.parse({"cdc": {"streams": [{**tuned, "compact_interval_s": 5}]}}, tmp_path / "c")
    s = cfg.cdc.streams[0]
    assert (s.compaction, s.target_file_bytes, s.compact_min_files, s.compact_interval_s) == (
        False,
        1 << 20,
        4,
        5.0,
    )
    assert s.path == tmp_path / "out"
    bad = {**stream, "compaction": "yes", "compact_min_files": 1, "target_file_bytes": 10}
    with pytest.raises(ConfigError) as err:
        config.parse({"cdc": {"streams": [bad]}})
    text = str(err.value)
    assert "cdc.streams[0].compaction" in text
    assert "cdc.streams[0].compact_min_files: expected an integer >= 2" in text
    assert "cdc.streams[0].target_file_bytes" in text
    shipped = config.load(ROOT / "config.toml").cdc.streams[0]
    assert (shipped.compaction, shipped.target_file_bytes) == (True, 128 * 1024 * 1024)


# -- [wal.archive] role --------------------------------------------------------------


def _standby(**cdc: object) -> dict[str, object]:
    return {"wal": {"archive": {"uri": "s3://lake/wal", "role": "standby"}}, "cdc": cdc}


def test_archive_role_defaults_to_primary_and_other_values_are_refused_naming_the_key() -> None:
    parsed = config.parse({"wal": {"archive": {"uri": "s3://lake/wal"}}})
    assert parsed.wal.archive is not None and parsed.wal.archive.role == "primary"
    assert config.parse(_standby()).wal.archive.role == "standby"  # type: ignore[union-attr]
    with pytest.raises(ConfigError) as info:
        config.parse({"wal": {"archive": {"uri": "s3://lake/wal", "role": "replica"}}})
    assert info.value.errors == [
        'wal.archive.role: expected one of "primary" | "standby", got "replica"'
    ]


def test_a_standby_refuses_local_streams_and_mirrors_naming_each_key_and_why() -> None:
    with pytest.raises(ConfigError) as info:
        config.parse(
            _standby(
                streams=[
                    {"name": "lake", "collections": ["*"], "path": "s3://lake/orders"},
                    {"name": "local", "collections": ["*"], "path": "tables/local"},
                ],
                mirrors=[{"name": "m", "collection": "orders", "path": "mirrors/m"}],
            )
        )
    stream, mirror = info.value.errors
    assert stream.startswith(
        'cdc.streams[1].path: stream "local" is the local folder tables/local; a standby '
        '([wal.archive] role = "standby") may name only tables on S3'
    )
    assert "this machine holds no table the primary wrote" in stream
    assert mirror.startswith('cdc.mirrors[0].path: mirror "m" is the local folder mirrors/m;')


def test_a_standby_with_tables_on_s3_only_is_accepted_and_a_primary_may_have_local_ones() -> None:
    on_s3 = _standby(
        streams=[{"name": "lake", "collections": ["*"], "path": "s3://lake/orders"}],
        mirrors=[{"name": "m", "collection": "orders", "path": "s3://lake/m"}],
    )
    assert config.parse(on_s3).cdc.streams[0].uri == "s3://lake/orders"
    primary = {
        "wal": {"archive": {"uri": "s3://lake/wal"}},
        "cdc": {"streams": [{"name": "local", "collections": ["*"], "path": "tables/local"}]},
    }
    assert config.parse(primary).cdc.streams[0].uri == ""


def test_a_shared_stream_needs_a_daemon_name_and_the_name_is_kept_after_path_resolution() -> None:
    plain = config.parse(_stream()).cdc.streams[0]
    assert plain.writers == "single"
    with pytest.raises(ConfigError) as info:
        config.parse(_stream(writers="shared"))
    (error,) = info.value.errors
    assert error.startswith(
        'daemon.name: required, since cdc.streams[0] ("s") has writers = "shared"'
    )
    cfg = config.parse({"daemon": {"name": "ep-1"}, **_stream(writers="shared")})
    assert cfg.daemon.name == "ep-1" and cfg.cdc.streams[0].writers == "shared"
    with pytest.raises(ConfigError) as info:
        config.parse({"daemon": {"name": "ep/1"}})
    assert info.value.errors[0].startswith("daemon.name: expected 1-63 letters")
    with pytest.raises(ConfigError) as info:
        config.parse(_stream(writers="many"))
    assert info.value.errors == [
        'cdc.streams[0].writers: expected one of "single" | "shared", got "many"'
    ]


@pytest.mark.parametrize(
    ("extra", "why"),
    [({"format": "parquet"}, 'format = "parquet"'), ({"variant": True}, "variant")],
)
def test_a_shared_parquet_or_variant_stream_is_refused_saying_why(
    extra: dict[str, object], why: str
) -> None:
    with pytest.raises(ConfigError) as info:
        config.parse({"daemon": {"name": "ep-1"}, **_stream(writers="shared", **extra)})
    (error,) = info.value.errors
    assert error.startswith(
        'cdc.streams[0].writers: a shared table (writers = "shared") is a Delta'
    )
    assert why in error and "Parquet folder's ledger has one writer" in error


def test_a_mirror_with_a_writers_key_is_refused_saying_why() -> None:
    mirror = {"name": "m", "collection": "orders", "path": "m", "writers": "shared"}
    with pytest.raises(ConfigError) as info:
        config.parse({"cdc": {"mirrors": [mirror]}})
    (error,) = info.value.errors
    assert error.startswith("cdc.mirrors[0].writers: a mirror has one writer")
    assert "do not order one key's events" in error


def test_merge_interval_ms_defaults_to_a_merge_per_batch_and_refuses_all_but_0_to_an_hour() -> None:
    def mirror(**extra: object) -> dict[str, object]:
        return {"cdc": {"mirrors": [{"name": "m", "collection": "orders", "path": "m", **extra}]}}

    assert config.parse(mirror()).cdc.mirrors[0].merge_interval_ms == 0
    assert config.parse(mirror(merge_interval_ms=1000)).cdc.mirrors[0].merge_interval_ms == 1000
    assert config.parse(mirror(merge_interval_ms=3_600_000)).cdc.mirrors[0].merge_interval_ms
    for bad, shown in ((-1, "-1"), (3_600_001, "3600001"), (1.5, "1.5"), (True, "True")):
        with pytest.raises(ConfigError) as info:
            config.parse(mirror(merge_interval_ms=bad))
        assert info.value.errors == [
            "cdc.mirrors[0].merge_interval_ms: expected an integer >= 0 and <= 3600000 "
            f"(an hour: the WAL and memory hold what waits), got {shown}"
        ]


def test_merge_max_events_defaults_to_a_million_and_refuses_what_memory_could_not_hold() -> None:
    def mirror(**extra: object) -> dict[str, object]:
        return {"cdc": {"mirrors": [{"name": "m", "collection": "orders", "path": "m", **extra}]}}

    assert config.parse(mirror()).cdc.mirrors[0].merge_max_events == 1_000_000
    assert config.parse(mirror(merge_max_events=5000)).cdc.mirrors[0].merge_max_events == 5000
    for bad in (0, 100_000_001, "many"):
        with pytest.raises(ConfigError) as info:
            config.parse(mirror(merge_max_events=bad))
        (error,) = info.value.errors
        assert error.startswith("cdc.mirrors[0].merge_max_events: expected an integer >= 1 and")
        assert "(the held batches' rows stay in memory)" in error
