"""The counting stub the core tests drive the scheduler with, in place of a model."""

from __future__ import annotations

from kvtune.core import Scheduler, SchedulerStep


def run_step(sched: Scheduler, token: int = 0) -> SchedulerStep:
    """One step: every request whose tokens are all computed samples one more."""
    step = sched.schedule()
    for req in step.sampling_requests():
        sched.append_token(req, token)
    return step


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))
