"""Spec checks that need no Spark: action keys, URLs, python functions, bounds."""

from __future__ import annotations

from typing import Any

from daemon.config import parse_triggers
from triggers import Retry, Spec, compile_specs
from triggers.spec import EmitAction, PythonAction, SqlAction, WebhookAction


def errors_of(*specs: Spec) -> list[str]:
    return compile_specs(list(specs))[1]


def test_valid_specs_compile_to_typed_actions() -> None:
    triggers, errors = compile_specs(
        [
            Spec(name="w", collection="c", action={"type": "webhook", "url": "https://h/x",
                 "timeout_s": 2, "headers": {"Authorization": "Bearer t"}}),
            Spec(name="p", collection="c", action={"type": "python",
                 "function": "tests.triggers.actions_for_tests:record_async"}),
            Spec(name="e", collection="c", action={"type": "emit", "collection": "d",
                 "op": "update"}),
            Spec(name="s", collection="c", action={"type": "sql",
                 "statement": "INSERT INTO t SELECT * FROM matched;"}),
        ]
    )  # fmt: skip
    assert errors == []
    w, p, e, s = (t.action for t in triggers)
    assert isinstance(w, WebhookAction) and w.timeout_s == 2.0
    assert w.headers == {"Authorization": "Bearer t"}
    assert isinstance(p, PythonAction) and p.is_async
    assert isinstance(e, EmitAction) and e.op == "update" and not e.has_expressions
    assert isinstance(s, SqlAction) and s.statement == "INSERT INTO t SELECT * FROM matched"
    assert triggers[0].initial_backoff_s == 0.5 and triggers[0].max_attempts == 5


def test_action_problems_name_the_trigger_and_the_key_path() -> None:
    errors = errors_of(
        Spec(name="a", collection="c", action={"type": "webhook", "url": "ftp://x"}),
        Spec(name="b", collection="c", action={"type": "webhook", "url": "http://h", "tmeout": 1}),
        Spec(name="c", collection="c", action={"type": "webhook", "url": "http://h",
             "timeout_s": 0, "headers": {"Idempotency-Key": "mine"}}),
        Spec(name="d", collection="c", action={"type": "python", "function": "no.such.mod:f"}),
        Spec(name="e", collection="c", action={"type": "python",
             "function": "tests.triggers.actions_for_tests:missing"}),
        Spec(name="f", collection="c", action={"type": "python",
             "function": "tests.triggers.actions_for_tests:NOT_CALLABLE"}),
        Spec(name="g", collection="c", action={"type": "emit", "collection": "d", "op": "upsert"}),
        Spec(name="h", collection="c", action={"type": "kafka"}),
        Spec(name="i", collection="c", action={"type": "sql"}),
    )  # fmt: skip
    assert (
        errors[0]
        == 'triggers[0] ("a").action.url: expected an http:// or https:// URL, got "ftp://x"'
    )
    assert errors[1].startswith('triggers[1] ("b").action.tmeout: unknown key for a webhook action')
    assert (
        errors[2] == 'triggers[2] ("c").action.timeout_s: expected a number of seconds > 0, got 0'
    )
    assert (
        errors[3]
        == 'triggers[2] ("c").action.headers.Idempotency-Key: set by eventplane; remove it'
    )
    assert errors[4].startswith(
        "triggers[3] (\"d\").action.function: cannot import module 'no.such.mod'"
    )
    assert errors[5].endswith("has no attribute 'missing'")
    assert errors[6].endswith("tests.triggers.actions_for_tests:NOT_CALLABLE is not callable")
    assert (
        errors[7]
        == 'triggers[6] ("g").action.op: expected "insert" | "update" | "delete", got "upsert"'
    )
    assert errors[8].startswith('triggers[7] ("h").action.type: unknown action type "kafka"')
    assert errors[9] == 'triggers[8] ("i").action.statement: required key is missing'
    assert len(errors) == 10


def test_spec_bounds_and_duplicates_are_rejected() -> None:
    emit: dict[str, Any] = {"type": "emit", "collection": "d"}
    errors = errors_of(
        Spec(name="x", collection="c", action=emit, batch_size=0),
        Spec(name="x", collection="c", action=emit),
        Spec(name="y", collection="c", action=emit, on=("upsert",)),
        Spec(name="z", collection="c", action=emit,
             retry=Retry(max_attempts=0, initial_backoff_ms=10, max_backoff_ms=5)),
    )  # fmt: skip
    assert errors == [
        'triggers[0] ("x").batch_size: expected an integer >= 1, got 0',
        'triggers[1] ("x").name: duplicate trigger name (also triggers[0])',
        'triggers[2] ("y").on: expected "insert" | "update" | "delete", got [\'upsert\']',
        'triggers[3] ("z").retry.max_attempts: expected >= 1, got 0',
        'triggers[3] ("z").retry.max_backoff_ms: must be >= initial_backoff_ms (10), got 5',
    ]


def test_config_parsed_specs_compile_with_their_defaults() -> None:
    errors: list[str] = []
    specs = parse_triggers(
        [{"name": "n", "collection": "orders", "when": "new:amount::double > 1000",
          "action": {"type": "webhook", "url": "http://127.0.0.1:8480/hook"}}],
        errors,
    )  # fmt: skip
    [t], problems = compile_specs(specs)
    assert errors == problems == []
    assert t.on == ("insert", "update", "delete") and t.batch_size == 1024
    assert t.max_attempts == 5 and t.initial_backoff_s == 0.5 and t.max_backoff_s == 60.0
    assert not t.fire_on_derived and t.enabled
