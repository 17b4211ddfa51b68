"""What the evaluations of one policy carry from one tick to the next, as plain values: the tuner state, the
sample window, the conditions, the knobs recommended and held, and which findings were on. The cluster keeps
one per policy beside its Kubernetes state (`k8s.reconcile.PolicyMemory`); the --local loop keeps one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvtune.operator.decide.findings import FindingKind
from kvtune.operator.decide.sample import Sample
from kvtune.operator.decide.status import ConditionState, Knobs
from kvtune.operator.decide.tuner import TunerState


@dataclass
class TickMemory:
    state: TunerState = field(default_factory=TunerState)  # also in status, to resume
    samples: deque[Sample] = field(default_factory=deque)  # memory only: rebuilt within a few intervals
    conditions: dict[str, ConditionState] = field(default_factory=dict)
    recommended: Knobs | None = None
    current: Knobs | None = None  # the knobs the engine held at the last tick that read them
    on: dict[FindingKind, str] = field(default_factory=dict)  # the findings on (`findings.transitions`)
