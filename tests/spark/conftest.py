"""Fixtures of the Spark tests: an executor factory on the shared session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from tests.spark import handlers
from tests.spark.support import make_config


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture(autouse=True)
def _clear_handler_calls() -> None:
    handlers.CALLS.clear()


@pytest.fixture
async def executor_factory(
    spark: Any, tmp_path: Path, metrics: Metrics
) -> AsyncIterator[Callable[..., Any]]:
    """``await make(**config_kwargs)`` -> a started SparkExecutor on the shared session."""
    made: list[SparkExecutor] = []

    async def make(
        *, wal_id: str = "wal-1", stages: Any = (), root: Path | None = None, **kwargs: Any
    ) -> SparkExecutor:
        cfg = make_config(root or tmp_path, **kwargs)
        ex = SparkExecutor(cfg, metrics, stages, wal_id=wal_id, session=spark)
        await ex.start()
        made.append(ex)
        return ex

    yield make
    for ex in made:
        await ex.stop()
