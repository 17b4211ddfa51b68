"""How many replicas a workload needs, pure: the fitted workload split over N replicas, each run through the
what-if at the objective's own pick, and the fewest N at which one replica holds.

A replica holds when the objective picks a value for its share of the demand and that value is predicted to
run with no preemption, a bounded queue and, where the policy states one, a p95 queue wait within its
bound. Peers size on a proxy (KV usage, the waiting queue); this sizes on the ceiling the engine's own
scheduler meets, with the same objective and margin as the admission pick (`kvtune.core.predict.plan`).

The demand is the workload's whole arrival: an open loop's request rate, or a closed loop's clients. One
replica's capacity is the most of it one replica holds (found by bisection, since holding only gets harder
with more demand); demand ÷ capacity is the load ratio, and its ceiling the replicas needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvtune.core.objectives import goodput as goodput_pick
from kvtune.core.predict import NO_PREEMPTION, Objective, plan
from kvtune.core.whatif import EDGE_SEEDS, Prediction, decision_table, predictions_for
from kvtune.core.workload_fit import Arrival, FittedWorkload

# capacity of an open loop is bisected to this share of itself: a replica count from a ratio this close to
# a whole number may be one off, which the next evaluation window corrects
RATE_TOLERANCE = 0.02
# the most replicas considered: beyond it the demand is reported as beyond the fleet
MAX_REPLICAS = 1024
# one replica's capacity is sought up to this many times the demand: beyond it, the ratio is reported as at
# most its inverse (a closed loop with no wait bound holds any number of clients on one replica)
CAPACITY_SPAN = 4


@dataclass(frozen=True)
class Demand:
    """The workload's whole arrival: `clients` of a closed loop, or `rate_per_s` of an open one."""

    clients: int | None = None
    rate_per_s: float | None = None

    def __post_init__(self) -> None:
        if (self.clients is None) == (self.rate_per_s is None):
            raise ValueError("a demand is a closed loop's clients or an open loop's rate, one of the two")

    @property
    def amount(self) -> float:
        return float(self.clients) if self.clients is not None else float(self.rate_per_s or 0.0)

    def describe(self) -> str:
        if self.clients is not None:
            return f"{self.clients} clients"
        return f"{self.rate_per_s or 0.0:.2f} requests/s"

    def share(self, replicas: int) -> Demand:
        """One replica's part when the demand is spread evenly over `replicas` (a client is never split)."""
        if self.clients is not None:
            return Demand(clients=max(1, math.ceil(self.clients / replicas)))
        return Demand(rate_per_s=(self.rate_per_s or 0.0) / replicas)

    def arrival(self) -> Arrival:
        evidence = f"{self.describe()} for one replica"
        return Arrival(self.clients, None if self.clients is not None else self.rate_per_s, evidence)


def fleet_demand(fit: FittedWorkload) -> Demand:
    """The whole workload's demand: an open loop's rate comes from the finished requests summed over the
    pods; a closed loop's clients from the requests in every pod (a pooled fit counts all of them)."""
    if fit.arrival.clients is not None:
        return Demand(clients=fit.arrival.clients)
    return Demand(rate_per_s=fit.arrival.rate_per_s or 0.0)


@dataclass(frozen=True)
class Verdict:
    """One replica under one share of the demand: the objective's pick among the values that hold there
    (None: no value holds), and why."""

    share: Demand
    pick: Prediction | None
    why: str

    @property
    def holds(self) -> bool:
        return self.pick is not None


def judge_share(
    fit: FittedWorkload,
    share: Demand,
    objective: Objective,
    low: int,
    high: int,
    wait_bound_s: float | None,
    edge_seeds: int = EDGE_SEEDS,
) -> Verdict:
    """Whether one replica holds `share`: some value in [low, high] is predicted never to preempt within the
    objective's risk margin (as NoPreemption's pick is judged), with a bounded queue and, with a bound, a p95
    queue wait within it. Among those the objective picks: NoPreemption the largest, Goodput the highest
    goodput."""
    one = replace(fit, arrival=share.arrival())
    # a closed loop never holds more requests than its clients: every value from `clients` up runs alike, and
    # the what-if simulates none above it, so a floor above the clients is judged at the clients
    if share.clients is not None:
        low = min(low, share.clients)
    planned = plan(one, min(max(fit.settings.max_num_seqs, low), high), objective, low, high, edge_seeds)
    margin = planned.objective.risk_margin
    safe = [r for r in planned.table if r.safe(margin) and not r.overloaded]
    if not safe:
        return Verdict(share, None, f"no value in [{low}, {high}] is predicted free of preemption")
    within = [r for r in safe if wait_bound_s is None or r.p95_queue_wait_s <= wait_bound_s]
    if not within:
        least = min(r.p95_queue_wait_s for r in safe)
        return Verdict(share, None, f"p95 queue wait {least:.2f} s at best > {wait_bound_s:g} s")
    if objective.name == NO_PREEMPTION:
        pick = max(within, key=lambda r: (r.candidate.max_num_seqs, r.goodput))
    else:
        pick = max(within, key=lambda r: (r.goodput, -r.candidate.max_num_seqs))
    return Verdict(share, pick, f"holds at max_num_seqs {pick.candidate.max_num_seqs}")


@dataclass(frozen=True)
class ReplicaPlan:
    """The replicas the demand needs and the setting each would run; None where no count holds, and why."""

    demand: Demand
    capacity: float | None  # the most demand one replica holds, in the demand's unit
    ratio: float | None  # demand ÷ capacity
    replicas: int | None
    max_num_seqs: int | None  # the objective's pick for one replica's share at `replicas`
    per_replica: Prediction | None  # the what-if of that pick
    reason: str

    def ratio_text(self) -> str:
        """The ratio, or `≤ 0.25` where one replica held CAPACITY_SPAN times the demand and the search
        stopped there."""
        if self.ratio is None:
            return "unknown"
        return f"≤ {self.ratio:.2f}" if self.ratio <= 1 / CAPACITY_SPAN + 1e-9 else f"{self.ratio:.2f}"

    def describe(self) -> str:
        if self.replicas is None or self.per_replica is None:
            return f"no replica count holds {self.demand.describe()}: {self.reason}"
        p = self.per_replica
        return (
            f"{self.replicas} replica{'s' if self.replicas != 1 else ''} at {self.demand.describe()} "
            f"(demand ÷ one replica's capacity {self.ratio_text()}), each at max_num_seqs {self.max_num_seqs}: "
            f"predicted 0 preemptions, p95 queue wait {p.p95_queue_wait_s:.2f} s, {p.goodput:.0f} tokens/s"
        )


def _capacity(holds: Callable[[Demand], bool], demand: Demand) -> float | None:
    """The most demand one replica holds (None: not even the least), bisected between held and not held."""
    if demand.clients is not None:
        if not holds(Demand(clients=1)):
            return None
        low, high = 1, 2
        while holds(Demand(clients=high)):
            if high >= CAPACITY_SPAN * demand.clients:
                return float(high)
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if holds(Demand(clients=middle)) else (low, middle)
        return float(low)
    rate = demand.rate_per_s or 0.0
    if rate <= 0:
        return math.inf
    low_rate, high_rate = 0.0, rate
    while holds(Demand(rate_per_s=high_rate)):
        if high_rate >= CAPACITY_SPAN * rate:
            return high_rate
        low_rate, high_rate = high_rate, high_rate * 2
    while high_rate - low_rate > RATE_TOLERANCE * high_rate:
        halfway = (low_rate + high_rate) / 2
        low_rate, high_rate = (
            (halfway, high_rate) if holds(Demand(rate_per_s=halfway)) else (low_rate, halfway)
        )
    return low_rate if low_rate > 0 else None


def replicas_needed(
    fit: FittedWorkload,
    demand: Demand,
    objective: Objective,
    low: int = 1,
    high: int = 1 << 20,
    wait_bound_s: float | None = None,
) -> ReplicaPlan:
    """The fewest replicas at which one replica holds its share of `demand`, with `objective`'s pick within
    [low, high] as its max_num_seqs. `wait_bound_s` defaults to the objective's p95 bound."""
    bound = wait_bound_s if wait_bound_s is not None else objective.p95_wait_bound_s
    verdicts: dict[tuple[Demand, int], Verdict] = {}

    def verdict(share: Demand, seeds: int = EDGE_SEEDS) -> Verdict:
        if (share, seeds) not in verdicts:
            verdicts[share, seeds] = judge_share(fit, share, objective, low, high, bound, seeds)
        return verdicts[share, seeds]

    # the search reads one seed per value (the edge's extra seeds walk every value, seconds a plan); the
    # count it lands on is then judged as the tuner judges its own pick
    capacity = _capacity(lambda share: verdict(share, 1).holds, demand)
    if capacity is None:
        least = Demand(clients=1) if demand.clients is not None else Demand(rate_per_s=demand.amount)
        why = verdict(least, 1).why
        return ReplicaPlan(
            demand, None, None, None, None, None, f"one replica does not hold the least: {why}"
        )
    ratio = demand.amount / capacity if capacity > 0 else math.inf
    replicas = max(1, math.ceil(ratio - 1e-9))
    while replicas <= MAX_REPLICAS and not verdict(demand.share(replicas)).holds:
        replicas += 1  # a closed loop's shares round up; the ratio's ceiling may fall one short
    if replicas > MAX_REPLICAS:
        return ReplicaPlan(demand, capacity, ratio, None, None, None, f"more than {MAX_REPLICAS} replicas")
    chosen = verdict(demand.share(replicas))
    pick = chosen.pick
    assert pick is not None  # the loop above stops at a count that holds
    value = max(low, pick.candidate.max_num_seqs)  # at or above a closed loop's clients: the same run
    return ReplicaPlan(demand, capacity, ratio, replicas, value, pick, chosen.why)


@dataclass(frozen=True)
class NoPreemptionCost:
    """What the NoPreemption pick gives up at today's demand on today's replicas: the goodput it keeps, the
    best the table offers (the Goodput pick where a bound is stated), the FP8 row, and the replicas that
    would hold today's goodput with no preemption."""

    pick: Prediction
    best: Prediction
    loss: float  # 1 - pick goodput / best goodput
    fp8: Prediction | None  # FP8 KV at the NoPreemption pick over the FP8 pool
    replicas_for_goodput: int | None
    goodput_target: float

    def describe(self) -> str:
        fp8 = (
            f"; FP8 KV: max_num_seqs {self.fp8.candidate.max_num_seqs} at {self.fp8.goodput:.0f} tokens/s, "
            f"{self.fp8.preemptions_per_min:.1f} preemptions/min"
            if self.fp8 is not None
            else ""
        )
        more = (
            f"; {self.replicas_for_goodput} replicas would hold {self.goodput_target:.0f} tokens/s with no "
            "preemption"
            if self.replicas_for_goodput is not None
            else ""
        )
        return (
            f"NoPreemption's pick, max_num_seqs {self.pick.candidate.max_num_seqs}, keeps "
            f"{self.pick.goodput:.0f} tokens/s, {self.loss:.0%} less than max_num_seqs "
            f"{self.best.candidate.max_num_seqs} ({self.best.goodput:.0f} tokens/s, "
            f"{self.best.preemptions_per_min:.1f} preemptions/min){fp8}{more}"
        )


def no_preemption_cost(
    fit: FittedWorkload,
    demand: Demand,
    objective: Objective,
    low: int,
    high: int,
    replicas: int,
    goodput_now: float,
    wait_bound_s: float | None = None,
) -> NoPreemptionCost | None:
    """The cost of the NoPreemption pick for one of `replicas` replicas sharing `demand` (None when the
    objective is not NoPreemption or there is no pick). The best row is the Goodput pick under
    `wait_bound_s`, else the highest goodput whose queue stays bounded. The replicas for goodput are the
    fewest whose NoPreemption picks, each over its share, add up to `goodput_now` (the fleet's today)."""
    if objective.name != NO_PREEMPTION:
        return None
    one = replace(fit, arrival=demand.share(replicas).arrival())
    applied = objective.for_fit(one)
    table = decision_table(one, round_to=applied.round_to, risk_margin=applied.risk_margin, with_fp8=True)
    plain = [r for r in predictions_for(table, fp8=False) if low <= r.candidate.max_num_seqs <= high]
    picked = applied.pick(plain).prediction
    if picked is None:
        return None
    if wait_bound_s is not None:
        best = goodput_pick(plain, wait_bound_s, applied.round_to).prediction or picked
    else:
        best = max((r for r in plain if not r.overloaded), key=lambda r: r.goodput, default=picked)
    loss = 1.0 - picked.goodput / best.goodput if best.goodput > 0 else 0.0
    fp8_rows = [r for r in predictions_for(table, fp8=True) if low <= r.candidate.max_num_seqs <= high]
    fp8 = applied.pick(fp8_rows).prediction if fp8_rows else None
    return NoPreemptionCost(picked, best, max(0.0, loss), fp8,
                            replicas_for_goodput(fit, demand, objective, low, high, goodput_now, picked.goodput),
                            goodput_now)  # fmt: skip


def replicas_for_goodput(
    fit: FittedWorkload,
    demand: Demand,
    objective: Objective,
    low: int,
    high: int,
    target: float,
    per_replica_guess: float,
    tries: int = 4,
) -> int | None:
    """The fewest replicas whose NoPreemption picks over their shares of `demand` generate `target` tokens/s
    together; from target ÷ one pick's goodput, checked and stepped up at most `tries` times (None: not
    reached, e.g. a closed loop whose shares grow too small to fill a pick)."""
    if per_replica_guess <= 0 or target <= 0:
        return None
    replicas = max(1, math.ceil(target / per_replica_guess - 1e-9))
    for _ in range(tries):
        if replicas > MAX_REPLICAS:
            return None
        verdict = judge_share(fit, demand.share(replicas), objective, low, high, None)
        pick = verdict.pick
        if pick is not None and pick.preemptions_per_min == 0 and pick.goodput * replicas >= target * 0.99:
            return replicas
        replicas += 1
    return None
