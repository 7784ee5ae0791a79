"""The project's modules import one way: no cycle, and each layer only from below.

Read from the source (``ast``), every import counts, at the top of a module or
inside a function: a cycle hidden in a function is still a cycle. The layer
rules are docs/design.md's map.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wal", "daemon", "triggers")
# (importer prefix, imported prefixes it must not use): docs/design.md, "Where each step lives".
FORBIDDEN = [
    ("daemon.metrics", ("daemon", "wal", "triggers")),
    ("wal", ("daemon", "triggers")),
    ("triggers", ("daemon.ingest", "daemon.service", "daemon.cli")),
    # The table layer sits below the executor; daemon.spark.session (the
    # session helpers, which import no project module) is the one part of
    # daemon.spark it uses.
    (
        "daemon.table",
        (
            "daemon.spark.executor",
            "daemon.spark.frame",
            "daemon.spark.lanes",
            "daemon.spark.lifecycle",
            "daemon.spark.maintenance",
            "daemon.spark.rawinbox",
            "daemon.spark.warmup",
            "daemon.service",
            "daemon.cli",
            "daemon.ingest",
            "triggers",
        ),
    ),
]


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports, anywhere in its source."""

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            # ``from pkg import mod`` imports the module pkg.mod when there is
            # one, else a name of pkg. A package's own __init__, which Python
            # runs first either way, is not counted: re-exports in an
            # __init__ would otherwise make every package a cycle.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for target in targets:
            hit = resolve(target)
            if hit is not None and hit != name:
                found.add(hit)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_project_imports_in_a_circle() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


# The layers above the service layer: the service itself and the CLI that starts it.
ABOVE_SERVICE = ("daemon.service", "daemon.cli")


def test_nothing_below_the_service_layer_imports_it() -> None:
    """The plane, the executor, the table layer, ingest, the WAL and the trigger
    engine write metrics through ``daemon.metrics``; ``service/`` depends on them,
    never the other way round."""
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph().items()
        if not any(module == a or module.startswith(a + ".") for a in ABOVE_SERVICE)
        for target in targets
        if target == "daemon.service" or target.startswith("daemon.service.")
    )
    assert wrong == []


@pytest.mark.parametrize(("importer", "banned"), FORBIDDEN, ids=[f[0] for f in FORBIDDEN])
def test_each_layer_imports_only_from_below(importer: str, banned: tuple[str, ...]) -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph().items()
        if module == importer or module.startswith(importer + ".")
        for target in targets
        if any(target == b or target.startswith(b + ".") for b in banned)
    )
    assert wrong == []
