"""Delta Lake's jars are pinned by version and by SHA-256 (daemon/spark/deltajars.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.spark import deltajars


def test_a_fetched_jar_whose_digest_differs_from_the_lock_is_removed_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = deltajars.ARTIFACTS[1]
    monkeypatch.setattr(deltajars, "ARTIFACTS", (storage,))
    monkeypatch.setitem(deltajars.SHA256, storage, "0" * 64)
    why = deltajars.fetch(tmp_path)
    assert why is not None
    assert why.startswith(f"{storage} as fetched has SHA-256 ")
    assert f"not the locked {'0' * 64}" in why
    assert not deltajars.jar_file(storage, tmp_path).exists()


def test_the_locked_jars_fetch_and_match_their_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deltajars, "ARTIFACTS", deltajars.ARTIFACTS[1:])
    assert deltajars.fetch(tmp_path) is None
    assert deltajars.missing(tmp_path) == []


@pytest.mark.parametrize(("ci", "code", "word"), [("true", 1, "error"), ("", 0, "note")])
def test_a_failed_fetch_fails_make_only_under_ci(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ci: str,
    code: int,
    word: str,
) -> None:
    """Under ``CI`` every Delta test must run, so a jar mvn cannot fetch fails
    ``make delta-jars``; elsewhere the install goes on and says why."""
    monkeypatch.setattr(deltajars, "missing", lambda folder=deltajars.JARS_DIR: [deltajars.PACKAGE])
    monkeypatch.setattr(
        deltajars, "fetch", lambda folder=deltajars.JARS_DIR: "mvn is not installed"
    )
    monkeypatch.setenv("CI", ci)
    assert deltajars.main([]) == code
    assert capsys.readouterr().err.startswith(f"{word}: mvn is not installed")
