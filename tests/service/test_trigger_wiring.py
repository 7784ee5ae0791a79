"""daemon.service.triggers: what a reload did to the trigger set, for reload.done."""

from __future__ import annotations

from daemon.service.triggers import trigger_changes
from tests.integration.harness import webhook_trigger
from triggers.spec import compile_specs


def _set(toml: str) -> dict[str, object]:
    import tomllib

    from daemon import config

    specs = config.parse(tomllib.loads(toml)).triggers
    triggers, errors = compile_specs(specs)
    assert errors == []
    return {t.name: t for t in triggers}


def test_reload_reports_added_removed_changed_and_unchanged_by_name() -> None:
    url = "http://127.0.0.1:9/hook"
    before = _set(
        webhook_trigger("a", "true", url)
        + webhook_trigger("b", "true", url)
        + webhook_trigger("c", "true", url)
    )
    # "c" only moves to the front; "b" changes its condition; "a" goes; "d" comes.
    after = _set(
        webhook_trigger("c", "true", url)
        + webhook_trigger("b", "false", url)
        + webhook_trigger("d", "true", url)
    )
    assert trigger_changes(before, after) == {  # type: ignore[arg-type]
        "added": ["d"],
        "removed": ["a"],
        "changed": ["b"],
        "unchanged": ["c"],
    }
