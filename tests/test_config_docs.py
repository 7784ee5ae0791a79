"""docs/configuration.md, "Every key" names every key the config parser accepts,
and only those, each with a default and a meaning.

The accepted keys come from the parser's own tables (``daemon.config.SECTIONS``,
its ``[[cdc.streams]]``, ``[[cdc.mirrors]]``, ``[[cdc.handlers]]``, ``[[ingest.tokens]]``,
``[[triggers]]`` and retry tables, and ``triggers.spec``'s keys of each action
type), so a key added to the parser without its row fails here, and so does a
row for a key the parser refuses."""

from __future__ import annotations

import re
from pathlib import Path

from daemon import config
from triggers import spec as trigger_spec

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def accepted_keys() -> set[str]:
    """Every key path the parser accepts: ``section.key``, ``array[].key``."""
    keys: set[str] = set()
    for section, (checks, _cls) in config.SECTIONS.items():
        for key in checks:
            if (section, key) == ("ingest", "tokens"):
                keys |= {f"ingest.tokens[].{k}" for k in config._TOKEN}
            elif (section, key) == ("wal", "archive"):
                keys |= {f"wal.archive.{k}" for k in config._WAL_ARCHIVE}
            else:
                keys.add(f"{section}.{key}")
    keys |= {f"cdc.streams[].{k}" for k in config._STREAM}
    keys |= {f"cdc.handlers[].{k}" for k in config._HANDLER}
    keys |= {f"cdc.mirrors[].{k}" for k in config._MIRROR}
    for key in config._TRIGGER:
        if key == "retry":
            keys |= {f"triggers[].retry.{k}" for k in config._RETRY}
        elif key == "action":
            keys.add("triggers[].action.type")
            for required, optional in trigger_spec._ACTION_KEYS.values():
                keys |= {f"triggers[].action.{k}" for k in (*required, *optional)}
        else:
            keys.add(f"triggers[].{key}")
    return keys


def documented_rows() -> dict[str, tuple[str, str]]:
    """Key path -> (default, meaning) of each row of "Every key". A row's first
    cell names one or more keys in backticks; a name without a dot takes the
    prefix of the row's first name (`` `ingest.header_timeout_s` / `body_timeout_s` ``)."""
    text = PAGE.read_text()
    body = text.split("\n## Every key\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("key", "") or set(cells[0]) <= set("-: "):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        assert names, f"docs/configuration.md: a row without a key: {line}"
        prefix = names[0].rpartition(".")[0] + "."
        for name in names:
            full = name if "." in name else prefix + name
            assert full not in rows, f"docs/configuration.md: {full} has two rows"
            rows[full] = (cells[1], cells[2])
    return rows


def test_the_parser_has_the_keys_it_is_compared_with() -> None:
    """The comparison itself is sound: spot checks of the derived key set."""
    keys = accepted_keys()
    assert {
        "daemon.cores",
        "cdc.streams[].start",
        "cdc.streams[].vacuum_retain_hours",
        "cdc.mirrors[].buckets",
        "ingest.tokens[].sha256",
        "triggers[].retry.max_attempts",
        "triggers[].action.timeout_s",
        "s3.lease_ttl_s",
    } <= keys
    assert "ingest.tokens" not in keys and "triggers[].action" not in keys


def test_every_accepted_key_is_documented() -> None:
    missing = sorted(accepted_keys() - set(documented_rows()))
    assert not missing, f'docs/configuration.md, "Every key" lacks: {missing}'


def test_every_documented_key_is_accepted() -> None:
    unknown = sorted(set(documented_rows()) - accepted_keys())
    assert not unknown, f'docs/configuration.md, "Every key" names unknown keys: {unknown}'


def test_every_row_has_a_default_and_a_meaning() -> None:
    rows = documented_rows()
    bare = sorted(k for k, (default, meaning) in rows.items() if not (default and meaning))
    assert not bare, f"docs/configuration.md: rows without a default or a meaning: {bare}"
