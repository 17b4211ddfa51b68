"""The simulator drives core's scheduler through the engine's own call: one `update_from_output` per step."""

from __future__ import annotations

from typing import Any

import pytest

from kvtune.core import Request, Scheduler
from kvtune.sim.distributions import LengthDistribution
from kvtune.sim.simulator import SimConfig, simulate
from kvtune.sim.workload import Workload


def test_the_simulator_updates_the_scheduler_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    update = Scheduler.update_from_output

    def counting(self: Scheduler, *args: Any, **kwargs: Any) -> list[Request]:
        calls.append(1)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "update_from_output", counting)
    workload = Workload(LengthDistribution("uniform", 20, 60), LengthDistribution("uniform", 5, 40), 64)
    result = simulate(SimConfig(workload, pool_tokens=2048, steps=60, warmup=10))
    assert len(calls) == 60
    assert result.delivered_tokens > 0
