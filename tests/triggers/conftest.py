"""Fixtures of the trigger tests: a loopback receiver, a fake clock, an engine factory.

The session ``spark`` fixture comes from tests/conftest.py (daemon.spark.session.build_session).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon.service.metrics import Metrics
from tests.triggers.support import FakeClock, Receiver
from triggers.engine import TriggerEngine


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver()
    await r.start()
    yield r
    await r.stop()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def emitted() -> list[dict[str, Any]]:
    return []


@pytest.fixture
async def make_engine(
    tmp_path: Path, clock: FakeClock, metrics: Metrics, emitted: list[dict[str, Any]]
) -> AsyncIterator[Callable[..., Any]]:
    """``await make(specs, spark=None, **kwargs)`` -> a started engine (no retry loop
    unless ``retry_loop=True``), validated with Spark when ``spark`` is given."""
    made: list[TriggerEngine] = []
    sessions: list[aiohttp.ClientSession] = []

    async def emit(events: list[dict[str, Any]]) -> None:
        emitted.extend(events)

    async def make(
        specs: Sequence[Any], spark: Any = None, *, retry_loop: bool = False, **kwargs: Any
    ) -> TriggerEngine:
        kwargs.setdefault("data_dir", tmp_path / "data")
        kwargs.setdefault("clock", clock)
        kwargs.setdefault("metrics", metrics)
        kwargs.setdefault("emit", emit)
        kwargs.setdefault("rng", random.Random(7))
        if "http" not in kwargs:
            session = aiohttp.ClientSession()
            sessions.append(session)
            kwargs["http"] = session
        engine = TriggerEngine(specs, **kwargs)
        if spark is not None:
            errors = engine.validate(spark)
            assert errors == [], errors
        await engine.start(retry_loop=retry_loop)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        await engine.stop()
    for session in sessions:
        await session.close()
