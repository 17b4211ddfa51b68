"""The ladder's test policy and one-step drivers over a preempting engine."""

from __future__ import annotations

from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.sample import EngineView, Sample
from kvtune.operator.decide.tuner import Decision, TunerState, decide
from kvtune.operator.decide.window import Window
from tests.operator.helpers import synthetic

POLICY = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=10, cooldown_s=10, cap_floor=64)


def preempting(t0: float, t1: float, running: float = 8, **kw: float) -> list[Sample]:
    return [synthetic(t0, preemptions=0, generated=0, kv=1.0, running=running, waiting=5, **kw),
            synthetic(t1, preemptions=50, generated=5000, kv=1.0, running=running, waiting=5, **kw)]  # fmt: skip


def step(samples: list[Sample], engine: EngineView, state: TunerState, now: float,
         policy: TuningPolicy = POLICY) -> tuple[Decision, TunerState]:  # fmt: skip
    return decide(Window.of(samples), engine, policy, state, now)
