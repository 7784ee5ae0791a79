"""Pause and resume refuse an unknown name with every name they take: the
plane's stages and ``trigger:<name>`` for each trigger, whichever kind of name
was wrong (``StagePauses``, with a stand-in plane and engine)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from daemon.plane.stages import UnknownStageError
from daemon.service.triggers import StagePauses

STAGES = ("cdc:all", "triggers")


class Plane:
    """The plane's pause API as far as StagePauses uses it."""

    planner = SimpleNamespace(stages=SimpleNamespace(names=STAGES))

    async def pause_stage(self, name: str, **_: Any) -> dict[str, Any]:
        raise UnknownStageError(name, STAGES)

    async def resume_stage(self, name: str) -> dict[str, Any]:
        raise UnknownStageError(name, STAGES)


class Engine:
    triggers = {"big-orders": object(), "audit": object()}

    def is_paused(self, name: str) -> bool:
        return False


EVERY_NAME = ("cdc:all", "triggers", "trigger:audit", "trigger:big-orders")


@pytest.mark.parametrize("name", ["cdc:nope", "trigger:nope"])
async def test_an_unknown_name_is_refused_with_every_stage_and_trigger(name: str) -> None:
    pauses = StagePauses(Plane(), lambda: Engine())

    for call in (pauses.pause_stage(name), pauses.resume_stage(name)):
        with pytest.raises(UnknownStageError) as refused:
            await call
        assert refused.value.name == name
        assert refused.value.names == EVERY_NAME


async def test_without_triggers_only_the_stages_are_named() -> None:
    pauses = StagePauses(Plane(), lambda: None)

    with pytest.raises(UnknownStageError) as refused:
        await pauses.pause_stage("trigger:audit")
    assert refused.value.names == STAGES
