"""Trigger specs: the shape the daemon hands in, the checks Spark is not needed
for, and the compiled form the engine runs.

``daemon.config`` does the structural checks of ``[[triggers]]`` (types, required
keys, duplicate names); this module goes deeper (action keys, URLs, importable
python functions, retry bounds). ``triggers.evaluate.analyze`` adds the Spark
analysis of ``when`` and the action expressions. Every message carries the key
path and the trigger's name::

    triggers[2] ("ship-it").action.url: expected an http:// or https:// URL, got "ftp://x"
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

# The batch DataFrame the Spark executor hands to every stage (the README's CDC
# columns plus depth/source for events made by emit actions).
BATCH_COLUMNS = (
    "lsn", "core", "seq", "collection", "op", "key", "new", "old",
    "ingest_ts", "batch_id", "event_id", "event_time", "producer", "depth", "source",
)  # fmt: skip
BATCH_SCHEMA_DDL = (
    "lsn BIGINT, core INT, seq BIGINT, collection STRING, op STRING, key STRING, "
    "new VARIANT, old VARIANT, ingest_ts TIMESTAMP, batch_id BIGINT, "
    "event_id STRING, event_time TIMESTAMP, producer STRING, depth INT, source STRING"
)
OPS = ("insert", "update", "delete")
# Issue 5: emit cascades stop at depth 16 (a producer's event has depth 0).
MAX_DEPTH = 16
DEFAULT_WEBHOOK_TIMEOUT_S = 10.0
# Headers the engine owns; a spec may not override them.
_RESERVED_HEADERS = frozenset({"idempotency-key", "content-type", "content-length"})


class RetryPolicyLike(Protocol):
    @property
    def max_attempts(self) -> int: ...

    @property
    def initial_backoff_ms(self) -> int: ...

    @property
    def max_backoff_ms(self) -> int: ...


class TriggerSpecLike(Protocol):
    """What ``daemon.config.TriggerSpec`` provides (read-only)."""

    @property
    def name(self) -> str: ...

    @property
    def collection(self) -> str: ...

    @property
    def on(self) -> Sequence[str]: ...

    @property
    def when(self) -> str: ...

    @property
    def action(self) -> Mapping[str, Any]: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def retry(self) -> RetryPolicyLike: ...

    @property
    def enabled(self) -> bool: ...

    @property
    def fire_on_derived(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Retry:
    """Same fields and defaults as ``daemon.config.RetryPolicy``."""

    max_attempts: int = 5
    initial_backoff_ms: int = 500
    max_backoff_ms: int = 60_000


@dataclass(frozen=True, slots=True)
class Spec:
    """Same fields and defaults as ``daemon.config.TriggerSpec``, for tools and
    tests that build triggers without a config file."""

    name: str
    collection: str
    action: Mapping[str, Any]
    on: tuple[str, ...] = OPS
    when: str = "true"
    batch_size: int = 1024
    retry: Retry = field(default_factory=Retry)
    enabled: bool = True
    fire_on_derived: bool = False


# --------------------------------------------------------------------------
# Compiled actions


@dataclass(frozen=True, slots=True)
class WebhookAction:
    url: str
    timeout_s: float = DEFAULT_WEBHOOK_TIMEOUT_S
    headers: Mapping[str, str] = field(default_factory=dict)
    kind: str = "webhook"


@dataclass(frozen=True, slots=True)
class PythonAction:
    function: str  # "pkg.mod:func"
    func: Callable[..., Any]
    is_async: bool
    kind: str = "python"


@dataclass(frozen=True, slots=True)
class EmitAction:
    collection: str
    op: str | None = None  # None: the matched row's op
    key: str | None = None  # Spark SQL expression; None: the matched row's key
    new: str | None = None  # Spark SQL expression (struct, map or variant); None: row's new
    kind: str = "emit"

    @property
    def has_expressions(self) -> bool:
        return self.key is not None or self.new is not None


@dataclass(frozen=True, slots=True)
class SqlAction:
    statement: str
    kind: str = "sql"


Action = WebhookAction | PythonAction | EmitAction | SqlAction


@dataclass(frozen=True, slots=True)
class Trigger:
    """A validated trigger, ready to evaluate and act."""

    index: int  # position in [[triggers]], for key paths
    name: str
    collection: str
    on: tuple[str, ...]
    when: str
    action: Action
    batch_size: int
    max_attempts: int
    initial_backoff_s: float
    max_backoff_s: float
    enabled: bool
    fire_on_derived: bool

    @property
    def where(self) -> str:
        return f'triggers[{self.index}] ("{self.name}")'


# --------------------------------------------------------------------------
# Checks without Spark

_ACTION_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # type: (required, optional)
    "webhook": (("url",), ("timeout_s", "headers")),
    "python": (("function",), ()),
    "emit": (("collection",), ("op", "key", "new")),
    "sql": (("statement",), ()),
}


def _nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def load_function(ref: str) -> Callable[..., Any]:
    """Import ``"pkg.mod:func"``; raises ``ValueError`` saying what is wrong."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f'expected "package.module:function", got {_show(ref)}')
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the user's to see
        raise ValueError(f"cannot import module {module_name!r}: {exc!r}") from exc
    func = getattr(module, attr, None)
    if func is None:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(func):
        raise ValueError(f"{ref} is not callable")
    return func  # type: ignore[no-any-return]


def _compile_action(raw: Mapping[str, Any], where: str, errors: list[str]) -> Action | None:
    path = f"{where}.action"
    kind = raw.get("type")
    if kind not in _ACTION_KEYS:
        shown = " | ".join(_ACTION_KEYS)
        errors.append(f"{path}.type: unknown action type {_show(kind)} (expected {shown})")
        return None
    required, optional = _ACTION_KEYS[kind]
    before = len(errors)
    for key in raw:
        if key != "type" and key not in required and key not in optional:
            known = ", ".join(sorted(("type", *required, *optional)))
            errors.append(f"{path}.{key}: unknown key for a {kind} action (known keys: {known})")
    for key in required:
        if key not in raw:
            errors.append(f"{path}.{key}: required key is missing")
        elif not _nonempty_str(raw[key]):
            errors.append(f"{path}.{key}: expected a non-empty string, got {_show(raw[key])}")
    if len(errors) != before:
        return None

    if kind == "webhook":
        url = raw["url"]
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            errors.append(f"{path}.url: expected an http:// or https:// URL, got {_show(url)}")
        timeout = raw.get("timeout_s", DEFAULT_WEBHOOK_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            errors.append(f"{path}.timeout_s: expected a number of seconds > 0, got {timeout!r}")
        headers = raw.get("headers", {})
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            errors.append(f"{path}.headers: expected a table of strings, got {headers!r}")
        else:
            for name in headers:
                if name.lower() in _RESERVED_HEADERS:
                    errors.append(f"{path}.headers.{name}: set by eventplane; remove it")
        if len(errors) != before:
            return None
        return WebhookAction(url, float(timeout), dict(headers))

    if kind == "python":
        try:
            func = load_function(raw["function"])
        except ValueError as exc:
            errors.append(f"{path}.function: {exc}")
            return None
        return PythonAction(raw["function"], func, inspect.iscoroutinefunction(func))

    if kind == "emit":
        op = raw.get("op")
        if op is not None and op not in OPS:
            errors.append(f'{path}.op: expected "insert" | "update" | "delete", got {_show(op)}')
        for key in ("key", "new"):
            if key in raw and not _nonempty_str(raw[key]):
                errors.append(f"{path}.{key}: expected a Spark SQL expression, got {raw[key]!r}")
        if len(errors) != before:
            return None
        return EmitAction(raw["collection"], op, raw.get("key"), raw.get("new"))

    return SqlAction(raw["statement"].strip().rstrip(";"))


def compile_specs(specs: Sequence[TriggerSpecLike]) -> tuple[list[Trigger], list[str]]:
    """Check what can be checked without Spark; return triggers and errors."""
    triggers: list[Trigger] = []
    errors: list[str] = []
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        where = f'triggers[{i}] ("{spec.name}")'
        before = len(errors)
        if not _nonempty_str(spec.name):
            errors.append(f"triggers[{i}].name: expected a non-empty string, got {spec.name!r}")
        elif spec.name in seen:
            errors.append(
                f"{where}.name: duplicate trigger name (also triggers[{seen[spec.name]}])"
            )
        else:
            seen[spec.name] = i
        if not _nonempty_str(spec.collection):
            errors.append(f"{where}.collection: expected a non-empty string")
        ops = tuple(dict.fromkeys(spec.on))
        if not ops or any(op not in OPS for op in ops):
            errors.append(f'{where}.on: expected "insert" | "update" | "delete", got {list(ops)}')
        if not _nonempty_str(spec.when):
            errors.append(f"{where}.when: expected a Spark SQL boolean expression")
        if spec.batch_size < 1:
            errors.append(f"{where}.batch_size: expected an integer >= 1, got {spec.batch_size}")
        r = spec.retry
        if r.max_attempts < 1:
            errors.append(f"{where}.retry.max_attempts: expected >= 1, got {r.max_attempts}")
        if r.initial_backoff_ms < 1:
            errors.append(
                f"{where}.retry.initial_backoff_ms: expected >= 1, got {r.initial_backoff_ms}"
            )
        if r.max_backoff_ms < r.initial_backoff_ms:
            errors.append(
                f"{where}.retry.max_backoff_ms: must be >= initial_backoff_ms "
                f"({r.initial_backoff_ms}), got {r.max_backoff_ms}"
            )
        action = _compile_action(spec.action, where, errors)
        if action is None or len(errors) != before:
            continue
        triggers.append(
            Trigger(
                index=i,
                name=spec.name,
                collection=spec.collection,
                on=ops,
                when=spec.when,
                action=action,
                batch_size=spec.batch_size,
                max_attempts=r.max_attempts,
                initial_backoff_s=r.initial_backoff_ms / 1000.0,
                max_backoff_s=r.max_backoff_ms / 1000.0,
                enabled=spec.enabled,
                fire_on_derived=spec.fire_on_derived,
            )
        )
    return triggers, errors
