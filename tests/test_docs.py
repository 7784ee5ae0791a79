"""The docs hold together: links and section citations resolve, the pages stay
a user guide (no dated headings, no commit hashes, line budgets), and every
code sample marked ``runnable`` runs (CONTRIBUTING.md, "Docs")."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon import config

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
GUIDE = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS]
MARKDOWN = [*GUIDE, ROOT / "CHANGELOG.md", ROOT / "bench" / "RESULTS.md"]
# Files outside Markdown that cite the docs (docstrings, comments, alert runbooks).
CITING_SUFFIXES = {".py", ".toml", ".yml", ".yaml", ".service", ".md"}
SKIP_DIRS = {".git", ".venv", "var", "node_modules", ".mypy_cache", ".ruff_cache"}

README_MAX_LINES = 250
# Raised from 4,500 for the WAL archive (docs/wal.md, operating.md), mirror
# tables (cdc.md), losing the machine and a standby (operating.md): a section
# per feature; to 4,900 for a standby's takeover, mirror history and shared tables.
DOCS_MAX_LINES = 4900

FENCE = re.compile(r"^(\s*)```(.*)$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# docs/x.md, "Section"  |  docs/x.md ("Section")  |  docs/x.md``, "Section"
CITATION = re.compile(
    r"(docs/[a-z_]+\.md|README)(?:\.md)?(?:``)?(?:,\s*|\s+\(\s*)[\"“]([A-Z`/][^\"”\n]{0,100}?)[\"”]"
)
ANCHOR = re.compile(r"(docs/[a-z_]+\.md)#([a-z0-9-]+)")
COMMIT_HASH = re.compile(r"(?<![0-9A-Za-z_/.-])[0-9a-f]{7,40}(?![0-9A-Za-z_-])")
DATED = re.compile(r"\b(19|20)\d\d\b|\b(morning|afternoon|evening|night)\b", re.I)


@dataclass
class Sample:
    path: Path
    line: int
    lang: str
    marker: str | None
    code: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang})"


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code."""
    out, fence = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fence = not fence
            continue
        if not fence:
            out.append((n, line))
    return out


def _headings(path: Path) -> list[str]:
    return [m.group(2) for _, line in _prose_lines(path) if (m := HEADING.match(line))]


def _plain(heading: str) -> str:
    return heading.replace("`", "").strip().lower()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _has_section(path: Path, cited: str) -> bool:
    want = _plain(cited)
    for heading in map(_plain, _headings(path)):
        if heading == want:
            return True
        if heading.startswith(want) and heading[len(want)] in ":,(- ":
            return True
    return False


def _samples(path: Path) -> list[Sample]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, words = m.group(1), m.group(2).split()
        j = i + 1
        while not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        code = "\n".join(x[len(indent) :] if x.startswith(indent) else x for x in lines[i + 1 : j])
        lang = words[0] if words else ""
        marker = words[1] if len(words) > 1 else None
        out.append(Sample(path, i + 1, lang, marker, code + "\n"))
        i = j + 1
    return out


SAMPLES = [s for p in GUIDE for s in _samples(p)]
RUNNABLE = [s for s in SAMPLES if s.marker == "runnable"]


def _citing_files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            p = Path(dirpath) / name
            if p.suffix in CITING_SUFFIXES and p.name != "test_docs.py":
                out.append(p)
    return sorted(out)


# -- budgets and style ---------------------------------------------------------


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines"


def test_docs_fit_their_budget() -> None:
    lines = sum(len(p.read_text().splitlines()) for p in DOCS)
    assert lines < DOCS_MAX_LINES, f"docs/ has {lines} lines"


def test_the_guide_has_no_dated_headings() -> None:
    dated = [
        f"{p.relative_to(ROOT)}: {h}"
        for p in [*DOCS, ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
        for h in _headings(p)
        if DATED.search(h)
    ]
    assert not dated, dated


def test_the_docs_cite_no_commit_hashes() -> None:
    found = []
    for p in [*DOCS, ROOT / "README.md", ROOT / "CONTRIBUTING.md"]:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            for word in COMMIT_HASH.findall(line):
                if re.search(r"\d", word) and re.search(r"[a-f]", word):
                    found.append(f"{p.relative_to(ROOT)}:{n}: {word}")
    assert not found, found


# -- links and citations -------------------------------------------------------


def test_relative_links_resolve() -> None:
    broken = []
    for p in MARKDOWN:
        for n, line in _prose_lines(p):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                dest = (p.parent / file).resolve() if file else p
                if not dest.exists():
                    broken.append(f"{p.relative_to(ROOT)}:{n}: {target}")
                elif (
                    anchor
                    and dest.suffix == ".md"
                    and anchor not in {_slug(h) for h in _headings(dest)}
                ):
                    broken.append(f"{p.relative_to(ROOT)}:{n}: #{anchor}")
    assert not broken, broken


def test_section_citations_resolve() -> None:
    """``docs/x.md, "Section"`` in the docs, the code and the alert rules names
    an existing heading (or the start of one, up to a colon or a parenthesis)."""
    broken = []
    for p in _citing_files():
        text = p.read_text(errors="replace")
        # A citation may wrap over lines, in a comment or a docstring.
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
        for doc, section in CITATION.findall(flat):
            doc = "README.md" if doc == "README" else doc
            if not (ROOT / doc).exists():
                broken.append(f"{p.relative_to(ROOT)}: {doc} does not exist")
            elif not _has_section(ROOT / doc, section):
                broken.append(f'{p.relative_to(ROOT)}: {doc}, "{section}"')
        for doc, anchor in ANCHOR.findall(text):
            if anchor not in {_slug(h) for h in _headings(ROOT / doc)}:
                broken.append(f"{p.relative_to(ROOT)}: {doc}#{anchor}")
    assert not broken, sorted(set(broken))


def test_cited_files_exist() -> None:
    missing = []
    for p in _citing_files():
        for doc in set(re.findall(r"\bdocs/[a-z_]+\.md\b", p.read_text(errors="replace"))):
            if not (ROOT / doc).exists():
                missing.append(f"{p.relative_to(ROOT)}: {doc}")
    assert not missing, missing


# -- samples ---------------------------------------------------------------------


def test_every_sample_is_marked() -> None:
    unmarked = [str(s) for s in SAMPLES if s.marker not in ("runnable", "illustrative")]
    assert not unmarked, f"mark these runnable or illustrative: {unmarked}"


def test_there_are_runnable_samples() -> None:
    assert {s.lang for s in RUNNABLE} >= {"toml", "python", "json", "sh"}


def unresolved_imports(code: str, name: str) -> list[str]:
    """Compile ``code`` (top-level ``await`` allowed), then import what each of
    its ``import`` statements names: what does not resolve, as written."""
    tree = compile(code, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT | ast.PyCF_ONLY_AST)
    compile(tree, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                try:
                    importlib.import_module(alias.name)
                except ImportError as exc:
                    wrong.append(f"import {alias.name} ({exc})")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            try:
                module = importlib.import_module(node.module)
            except ImportError as exc:
                wrong.append(f"from {node.module} ({exc})")
                continue
            for alias in node.names:
                if alias.name == "*" or hasattr(module, alias.name):
                    continue
                try:  # a submodule not imported by its package
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    wrong.append(f"from {node.module} import {alias.name}")
    return wrong


def test_a_python_sample_whose_import_does_not_resolve_is_caught() -> None:
    code = "from daemon.snapshot import consistently\nimport no_such_module\nawait x()\n"
    assert len(unresolved_imports(code, "sample")) == 2
    assert unresolved_imports("from daemon.snapshot import consistent\n", "sample") == []


@pytest.mark.parametrize("sample", RUNNABLE, ids=str)
def test_runnable_sample(sample: Sample, tmp_path: Path) -> None:
    if sample.lang == "toml":
        raw = tomllib.loads(sample.code)
        config.parse(raw, source=tmp_path / "config.toml")
    elif sample.lang == "python":
        unresolved = unresolved_imports(sample.code, str(sample))
        assert not unresolved, f"{sample}: imports that do not resolve: {unresolved}"
    elif sample.lang == "json":
        json.loads(sample.code)
    elif sample.lang == "sh":
        # The scratch folder stands for a checkout after `make`: its CLI is
        # .venv/bin/eventplane (CONTRIBUTING.md, "Docs").
        cli = tmp_path / ".venv" / "bin" / "eventplane"
        cli.parent.mkdir(parents=True)
        cli.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m daemon.cli.main "$@"\n')
        cli.chmod(0o755)
        # Bare `eventplane` is not defined: it is the CLI only on PATH (an
        # activated venv, or an install), which a reader of a checkout lacks.
        done = subprocess.run(
            ["bash", "-c", "set -e\n" + sample.code],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
    else:
        pytest.fail(f"{sample}: no way to run a {sample.lang!r} sample; mark it illustrative")
