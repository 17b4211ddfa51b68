"""The two doors of the decision core: where samples come from (`MetricSource`) and what changes an
engine's knobs (`Actuator`). `io/` and `k8s/` implement them; `decide/` only calls them, so the loop runs
the same against one engine's admin API, a Deployment's args or every pod of a workload.

A failure is returned as a result (`NoData`, `ActuatorResult.ok` False), never raised: a missing source or
an unreachable engine becomes a finding and the operator keeps running.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvtune.operator.decide.sample import SampleResult

KnobReadings = dict[str, int | None]  # knob name -> the value an engine (or a pod) reports holding


@dataclass(frozen=True)
class ActuatorResult:
    ok: bool
    values: KnobReadings  # the knobs as the engine reports them after the call (empty on failure)
    error: str | None = None
    split: frozenset[str] = frozenset()  # knobs the parts (pods) hold different values of: None in values


@dataclass(frozen=True)
class ActuatorInfo:
    """What the status and the Events say about an actuator, beside the knobs it reads: why (part of) it
    could not be built, the vLLM flag it patches for max_num_seqs, and what each pod last said it holds."""

    unavailable: str | None = None
    admission_flag: str | None = None  # "flag (why that one)"
    held_by_pod: Mapping[str, KnobReadings] = field(default_factory=dict)


def combined(infos: list[ActuatorInfo]) -> ActuatorInfo:
    """The parts of a composed actuator as one: every part's reason to be unavailable, the first part's
    flag, and every pod's readings."""
    held: dict[str, KnobReadings] = {}
    for info in infos:
        for pod, values in info.held_by_pod.items():
            held.setdefault(pod, {}).update(values)
    return ActuatorInfo(
        unavailable="; ".join(info.unavailable for info in infos if info.unavailable) or None,
        admission_flag=next((info.admission_flag for info in infos if info.admission_flag), None),
        held_by_pod=held,
    )


class Actuator(Protocol):
    knobs: frozenset[str]  # which knobs this actuator can change

    def current(self) -> ActuatorResult: ...

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        """Set `knob`; `cause` (why, with the evidence) goes where the target keeps an audit trail."""
        ...

    def describe(self) -> ActuatorInfo: ...


class MetricSource(Protocol):
    def read(self) -> SampleResult: ...

    @property
    def proxy_problem(self) -> str | None:
        """Why a kvtune proxy's /metrics (its defeat and cap series) could not be read at the last read;
        None when it was, or when the source has no proxy."""
        ...
