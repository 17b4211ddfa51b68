"""The doctor's what-if table: the workload fitted from the samples the doctor took (or from Prometheus'
look-back with --since), every candidate max_num_seqs simulated over it, and both objectives' picks, the
one in force marked as the recommendation (`kvtune.core.predict`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvtune.core.objectives import goodput, no_preemption
from kvtune.core.predict import GOODPUT, Forecast, Objective, plan, table_lines
from kvtune.core.replicas import fleet_demand, no_preemption_cost, replicas_needed
from kvtune.core.whatif import Prediction
from kvtune.core.workload_fit import FittedWorkload, Insufficient
from kvtune.operator.decide.fit_window import fit_from_window
from kvtune.operator.decide.policy import ScalingPolicy
from kvtune.operator.decide.sample import EngineView, Sample
from kvtune.operator.decide.scaling import replicas_in
from kvtune.operator.decide.window import Window


def _row(p: Prediction, marks: dict[int, str], current: int) -> dict[str, Any]:
    value = p.candidate.max_num_seqs
    return {
        "max_num_seqs": value,
        "predicted_preemptions_per_min": p.preemptions_per_min,
        "predicted_goodput_tokens_per_s": p.goodput,
        "predicted_p95_queue_wait_s": p.p95_queue_wait_s,
        "peak_kv_usage": p.peak_kv_usage,
        "pick": marks.get(value),
        "in_force": value == current,
    }


def what_if_section(
    samples: Sequence[Sample],
    engine: EngineView,
    objective: Objective,
    *,
    bounds: tuple[int, int] = (1, 1 << 20),
    round_why: str = "",
    unknown: str = "the engine's max_num_seqs is unknown (pass --max-num-seqs N)",
    replicas: bool = True,
) -> dict[str, Any]:
    """The what-if data for the report: the fit in one line, the rows, the picks, or why there is none
    (`unknown`: the one line that says which flag gives max_num_seqs). `bounds` are the policy's
    [min, max] max_num_seqs, the ones the operator's tuner plans within. `replicas`: also size the replicas
    this load needs, a what-if search of its own (about ten plans), which the operator too runs only when
    asked (`spec.scaling`)."""
    if engine.max_num_seqs is None:
        return {"insufficient": unknown}
    window = Window.of(samples)
    fit = fit_from_window(window, engine)
    if isinstance(fit, Insufficient):
        return {"insufficient": str(fit)}
    current = engine.max_num_seqs
    result = plan(fit, current, objective, *bounds)
    sized = replicas_section(fit, window, objective) if replicas else None
    objective = result.objective  # with the margin that covers this fit's error, as the tuner uses it
    rows = list(result.table)
    if all(p.candidate.max_num_seqs != current for p in rows):
        rows = sorted([*rows, result.current], key=lambda p: p.candidate.max_num_seqs)
    safe = no_preemption(rows, objective.risk_margin, objective.round_to)
    bound = objective.p95_wait_bound_s if objective.name == GOODPUT else math.inf
    best = goodput(rows, bound if bound is not None else math.inf, objective.round_to)
    marks: dict[int, str] = {}
    for pick, label in ((best, "Goodput pick"), (safe, "NoPreemption pick")):
        if pick.max_num_seqs is not None:
            marks[pick.max_num_seqs] = (
                f"{marks[pick.max_num_seqs]}, {label}" if pick.max_num_seqs in marks else label
            )
    outcome = result.outcome
    recommended = outcome.value if isinstance(outcome, Forecast) else None
    if recommended is not None:
        marks[recommended] = f"{marks.get(recommended, '')} (recommended)".strip()
    return {
        "workload": fit.summary(),
        "confidence": fit.confidence,
        "objective": objective.describe(),
        "round_to": objective.round_to,
        "round_to_why": round_why,
        "current": _row(result.current, {}, current),
        "observed_preemptions_per_min": fit.observed.preemptions_per_min,
        "observed_goodput_tokens_per_s": fit.observed.goodput,
        "candidates": [_row(p, marks, current) for p in rows],
        "recommended": recommended,
        "reason": outcome.reason,
        "no_preemption_pick": safe.max_num_seqs,
        "goodput_pick": best.max_num_seqs,
        "table": table_lines(rows, current, marks),
        "replicas": sized,
    }


def replicas_section(fit: FittedWorkload, window: Window, objective: Objective) -> dict[str, Any]:
    """The replicas this load needs at the objective (`kvtune.core.replicas`), and what NoPreemption's pick
    costs in goodput when that is more than the operator's default warning share."""
    now = replicas_in(window)
    demand = fleet_demand(fit)
    planned = replicas_needed(fit, demand, objective)
    cost = no_preemption_cost(fit, demand, objective, 1, 1 << 20, now, fit.observed.goodput,
                              objective.p95_wait_bound_s)  # fmt: skip
    costly = cost is not None and cost.loss > ScalingPolicy.goodput_loss_warning
    return {
        "replicas_now": now,
        "demand": demand.describe(),
        "replicas_needed": planned.replicas,
        "demand_capacity_ratio": planned.ratio,
        "max_num_seqs_per_replica": planned.max_num_seqs,
        "text": planned.describe(),
        "no_preemption_goodput_loss": cost.loss if cost is not None else None,
        "no_preemption_cost": cost.describe() if cost is not None and costly else None,
    }


def what_if_text(section: dict[str, Any] | None) -> list[str]:
    if section is None:
        return []
    if "insufficient" in section:
        return ["What-if: no table", f"      {section['insufficient']}"]
    current = section["current"]
    why = f": {section['round_to_why']}" if section.get("round_to_why") else ""
    lines = [
        f"What-if ({section['objective']} in force; max_num_seqs in multiples of {section['round_to']}{why})",
        f"  fitted workload: {section['workload']}",
        f"  at max_num_seqs {current['max_num_seqs']} (in force): predicted "
        f"{current['predicted_preemptions_per_min']:.1f} preemptions/min, observed "
        f"{section['observed_preemptions_per_min']:.1f}; goodput predicted "
        f"{current['predicted_goodput_tokens_per_s']:.0f}, observed {section['observed_goodput_tokens_per_s']:.0f} "
        "tokens/s",
        *(f"  {line}" for line in section["table"]),
    ]
    if section["recommended"] is not None:
        lines.append(f"  recommendation: max_num_seqs {section['recommended']}: {section['reason']}")
    else:
        lines.append(f"  no recommendation: {section['reason']}")
    replicas = section.get("replicas")
    if replicas:
        lines.append(f"  replicas needed at this load: {replicas['text']} (now {replicas['replicas_now']})")
        if replicas["no_preemption_cost"]:
            lines.append(f"  NoPreemption costs goodput: {replicas['no_preemption_cost']}")
    return lines
