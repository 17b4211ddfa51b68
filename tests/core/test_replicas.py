"""The replica count: the fewest replicas at which one replica holds its share of the demand, at the same
objective and margin as the admission pick."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.core.predict import Objective
from kvtune.core.replicas import (
    CAPACITY_SPAN,
    Demand,
    fleet_demand,
    judge_share,
    no_preemption_cost,
    replicas_needed,
)
from kvtune.core.workload_fit import Arrival, FittedWorkload, fit_workload
from tests.core.workloads import window


def seeded_fit(
    seed: int, count: int, prompt: tuple[int, int], output: tuple[int, int], **settings: Any
) -> FittedWorkload:
    """The fit of `count` requests whose prompt, then output, lengths come uniform from one seeded stream;
    `settings` are the window's (pool, max_num_seqs, clients in the system, running)."""
    rng = random.Random(seed)
    prompts = [rng.randint(*prompt) for _ in range(count)]
    outputs = [rng.randint(*output) for _ in range(count)]
    fit = fit_workload(window(prompts, outputs, **settings))
    assert isinstance(fit, FittedWorkload)
    return fit


@pytest.fixture(scope="module")
def long_tailed() -> FittedWorkload:
    """The issue's workload: pool 6,144 tokens, prompts 100:2400, outputs 20:1200."""
    return seeded_fit(1, 200, (100, 2400), (20, 1200), pool_tokens=6144, max_num_seqs=128, in_system=(24,) * 13,
                      running=12)  # fmt: skip


def test_a_demand_is_clients_or_a_rate_and_splits_without_splitting_a_client() -> None:
    with pytest.raises(ValueError):
        Demand()
    with pytest.raises(ValueError):
        Demand(clients=3, rate_per_s=1.0)
    assert Demand(clients=24).share(5) == Demand(clients=5)
    assert Demand(rate_per_s=3.0).share(4) == Demand(rate_per_s=0.75)


def test_the_fleet_s_demand_is_the_fit_s_whole_arrival(long_tailed: FittedWorkload) -> None:
    assert fleet_demand(long_tailed) == Demand(clients=24)
    open_loop = dataclasses.replace(long_tailed, arrival=Arrival(None, 2.5, ""))
    assert fleet_demand(open_loop) == Demand(rate_per_s=2.5)  # finished requests: summed over the pods


def test_a_wait_bound_one_replica_cannot_meet_asks_for_more(long_tailed: FittedWorkload) -> None:
    bound = Objective(p95_wait_bound_s=5.0)
    one = judge_share(long_tailed, Demand(clients=24), bound, 1, 128, 5.0)
    assert not one.holds and "p95 queue wait" in one.why
    planned = replicas_needed(long_tailed, Demand(clients=24), bound, 1, 128)
    assert planned.replicas is not None and planned.replicas > 1
    assert planned.ratio is not None and planned.replicas >= planned.ratio
    assert planned.per_replica is not None
    assert planned.per_replica.preemptions_per_min == 0 and planned.per_replica.p95_queue_wait_s <= 5.0
    # one fewer does not hold: the count is the fewest
    fewer = judge_share(long_tailed, Demand(clients=24).share(planned.replicas - 1), bound, 1, 128, 5.0)
    assert not fewer.holds


def test_a_closed_loop_without_a_bound_is_held_by_one_replica(long_tailed: FittedWorkload) -> None:
    planned = replicas_needed(long_tailed, Demand(clients=24), Objective(), 1, 128)
    assert planned.replicas == 1 and planned.max_num_seqs is not None
    assert planned.ratio is not None and planned.ratio <= 1 / CAPACITY_SPAN
    assert planned.ratio_text().startswith("≤")


def test_an_open_loop_needs_more_replicas_for_more_demand(long_tailed: FittedWorkload) -> None:
    objective = Objective(p95_wait_bound_s=2.0)
    light = replicas_needed(long_tailed, Demand(rate_per_s=0.3), objective, 1, 128)
    heavy = replicas_needed(long_tailed, Demand(rate_per_s=3.0), objective, 1, 128)
    assert light.replicas == 1
    assert heavy.replicas is not None and heavy.replicas > light.replicas
    assert "replicas at 3.00 requests/s" in heavy.describe()


def test_requests_longer_than_the_pool_hold_on_no_count(long_tailed: FittedWorkload) -> None:
    tiny_pool = dataclasses.replace(
        long_tailed, settings=dataclasses.replace(long_tailed.settings, pool_tokens=512)
    )
    planned = replicas_needed(tiny_pool, Demand(clients=4), Objective(), 1, 128)
    assert planned.replicas is None and "one replica does not hold the least" in planned.reason
    assert planned.describe().startswith("no replica count holds")


def test_no_preemption_says_what_it_costs(long_tailed: FittedWorkload) -> None:
    cost = no_preemption_cost(long_tailed, Demand(clients=24), Objective(), 1, 128, 1, 1239.0)
    assert cost is not None
    assert cost.pick.preemptions_per_min == 0 and cost.best.goodput > cost.pick.goodput
    assert 0 < cost.loss < 1
    assert cost.replicas_for_goodput is not None and cost.replicas_for_goodput >= 2
    assert cost.fp8 is not None and cost.fp8.candidate.fp8
    assert "less than max_num_seqs" in cost.describe()
    assert (
        no_preemption_cost(long_tailed, Demand(clients=24), Objective("Goodput", 5.0), 1, 128, 1, 1.0) is None
    )


@settings(max_examples=6, deadline=None)
@given(st.integers(min_value=1, max_value=48))
def test_more_clients_never_need_fewer_replicas(clients: int) -> None:
    fit = seeded_fit(2, 120, (100, 1200), (20, 600), pool_tokens=8192, max_num_seqs=64, in_system=(12,) * 13,
                     running=8)  # fmt: skip
    objective = Objective(p95_wait_bound_s=3.0)
    fewer = replicas_needed(fit, Demand(clients=clients), objective, 1, 64)
    more = replicas_needed(fit, Demand(clients=clients + 8), objective, 1, 64)
    assert fewer.replicas is not None and more.replicas is not None
    assert more.replicas >= fewer.replicas


def test_a_floor_above_a_replica_s_clients_is_judged_at_the_clients(long_tailed: FittedWorkload) -> None:
    planned = replicas_needed(long_tailed, Demand(clients=3), Objective(p95_wait_bound_s=5.0), 4, 128)
    assert planned.replicas is not None and planned.max_num_seqs is not None and planned.max_num_seqs >= 4
