"""The replica signal, pure: once per evaluation window, the replicas the observed demand needs
(`kvtune.core.replicas`) at the tuner's own objective and margin, for the autoscaler the cluster runs to act
on. The operator never sets replicas itself.

Admission comes first: while a change of the tuner's is pending (its rollout, its evaluation window) the
signal holds where it was, since the window mixes two settings. A larger count is said at once; a smaller
one only when two evaluations a window apart agree, so a lull between bursts never removes a replica, and
the autoscaler's own scale-down policy then takes pods away one at a time (the chart's default).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtune.contract import metrics as m
from kvtune.core.replicas import Demand, ReplicaPlan, fleet_demand, no_preemption_cost, replicas_needed
from kvtune.core.workload_fit import FittedWorkload, Insufficient
from kvtune.operator.decide.fit_window import fit_from_window
from kvtune.operator.decide.policy import ScalingPolicy, TuningPolicy
from kvtune.operator.decide.prediction import fit_limits, objective_of
from kvtune.operator.decide.sample import EngineView
from kvtune.operator.decide.window import Window


@dataclass(frozen=True)
class ScalingSignal:
    """What the operator tells the autoscaler, and why."""

    at: float
    replicas_now: int  # pods the window's samples came from
    desired: int | None  # None: no count can be said (no fit, or no count holds): the autoscaler holds
    ratio: float | None  # demand ÷ one replica's capacity
    max_num_seqs: int | None  # the per-replica setting at `desired`
    demand: str
    reason: str
    held: str | None = None  # why the signal did not move at this evaluation
    demand_evidence: str = ""  # what the demand was read from (the fit's in-system count)
    # NoPreemption's pick at today's replicas loses more goodput than the policy's warning share
    costly: str | None = None
    goodput_loss: float | None = None


@dataclass(frozen=True)
class ScalingState:
    signal: ScalingSignal | None = None
    lower_seen: int | None = None  # a smaller count the last evaluation found, awaiting a second


def replicas_in(window: Window) -> int:
    """The pods the window's samples pooled (the latest sample's count; one where a single engine is read)."""
    latest = window.samples[-1].gauges.get(m.POOLED_PODS) if window.samples else None
    return max(1, round(latest)) if latest else 1


def plan_replicas(fit: FittedWorkload, policy: TuningPolicy) -> ReplicaPlan:
    """The replicas the fleet's demand needs, each replica at the tuner's objective within its bounds."""
    demand = fleet_demand(fit)
    return replicas_needed(fit, demand, objective_of(policy), policy.min_max_num_seqs,
                           policy.max_max_num_seqs)  # fmt: skip


def _cost(
    fit: FittedWorkload, demand: Demand, policy: TuningPolicy, scaling: ScalingPolicy, replicas: int
) -> tuple[str | None, float | None]:
    """NoPreemption's cost at today's replicas: its text when beyond the warning share, and the share."""
    cost = no_preemption_cost(fit, demand, objective_of(policy), policy.min_max_num_seqs,
                              policy.max_max_num_seqs, replicas, fit.observed.goodput,
                              policy.p95_wait_bound_s)  # fmt: skip
    if cost is None:
        return None, None
    text = cost.describe() if cost.loss > scaling.goodput_loss_warning else None
    return text, cost.loss


def evaluate(
    window: Window, engine: EngineView, policy: TuningPolicy, pending: bool, state: ScalingState, now: float
) -> ScalingState:
    """The signal at this tick: recomputed once per evaluation window, held while `pending` (a tuner change
    awaits its rollout or verdict), lowered only on a second evaluation that agrees. `window` starts at the
    tuner's last action, so it holds one setting."""
    scaling = policy.scaling
    if scaling is None:
        return ScalingState()
    previous = state.signal
    if previous is not None and now - previous.at < policy.evaluation_window_s:
        return state
    replicas_now = replicas_in(window)
    if pending:
        held = "admission first: a max_num_seqs change of the operator's is rolling out or being judged"
        signal = (
            replace(previous, at=now, held=held)
            if previous is not None
            else ScalingSignal(now, replicas_now, None, None, None, "", held, held)
        )
        return replace(state, signal=signal)
    fit = fit_from_window(window, engine, limits=fit_limits(policy))
    if isinstance(fit, Insufficient):
        reason = f"no fit of the workload: {fit}"
        kept = previous.desired if previous is not None else None
        return replace(state, signal=ScalingSignal(now, replicas_now, kept, None, None, "", reason,
                                                   "holding the last count" if kept else None))  # fmt: skip
    planned = plan_replicas(fit, policy)
    costly, loss = _cost(fit, planned.demand, policy, scaling, replicas_now)
    base = ScalingSignal(now, replicas_now, None, planned.ratio, planned.max_num_seqs, planned.demand.describe(),
                         planned.describe(), costly=costly, goodput_loss=loss,
                         demand_evidence=fit.arrival.evidence)  # fmt: skip
    if planned.replicas is None:
        kept = previous.desired if previous is not None else None
        return ScalingState(
            replace(base, desired=kept, held="no count holds: the last one stands" if kept else None)
        )
    wanted = scaling.clamp(planned.replicas)
    before = previous.desired if previous is not None else None
    if before is not None and wanted < before:
        if state.lower_seen is None:
            held = f"{wanted} would do; a second evaluation must agree before a replica is taken away"
            return ScalingState(replace(base, desired=before, held=held), lower_seen=wanted)
        wanted = max(wanted, state.lower_seen)  # the higher of the two agreeing evaluations
    return ScalingState(replace(base, desired=wanted))
