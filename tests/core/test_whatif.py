"""What-if runs over a fitted workload: deterministic, consistent across candidates, and exact where the
table shares a run between candidates or the pick's risk margin claims one."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.core.objectives import no_preemption
from kvtune.core.step_time import StepTimeModel
from kvtune.core.whatif import (
    DEFAULT_RISK_MARGIN,
    EDGE_SEEDS,
    Candidate,
    Horizon,
    decision_table,
    effective,
    fp8_pool_factor,
    isotonic,
    max_num_seqs_candidates,
    pooled,
    predictions_for,
    simulate,
    simulate_seeds,
    standard_candidates,
    what_if,
)
from kvtune.core.workload_fit import Arrival
from tests.core.workloads import fitted

SHORT = Horizon(warmup_lifetimes=1.0, measured_lifetimes=3.0, min_measured_steps=200)
DEFAULT = fitted()  # the tuner benchmark's default workload: pool ÷ mean footprint 9.1, 16 clients

workloads = st.builds(
    lambda ratio, prompt, output, clients: fitted(
        (prompt, 2 * prompt), (output, 2 * output), pool_tokens=max(4096, int(ratio * 1.5 * (prompt + output)) // 16 * 16),
        in_system=(clients,) * 13,
    ),
    ratio=st.floats(3, 20),
    prompt=st.integers(20, 300),
    output=st.integers(20, 300),
    clients=st.integers(4, 40),
)  # fmt: skip


def test_the_same_seed_gives_the_same_table_and_the_default_workload_reads_as_measured() -> None:
    values = [4, 6, 8, 10, 12, 16]
    first = what_if(DEFAULT, [Candidate(v) for v in values], seed=3)
    again = what_if(DEFAULT, [Candidate(v) for v in values], seed=3)
    assert first == again
    by_value = {p.candidate.max_num_seqs: p for p in first}
    # the tuner benchmark measured this workload: 8 and below clean, 10 and above preempting
    assert all(by_value[v].preemptions_per_min == 0 for v in (4, 6, 8))
    assert all(by_value[v].preemptions_per_min > 0 for v in (10, 12, 16))
    assert by_value[4].p95_queue_wait_s > by_value[8].p95_queue_wait_s  # fewer slots, longer queue


@settings(max_examples=12, deadline=None)
@given(fit=workloads, seed=st.integers(0, 100))
def test_more_max_num_seqs_never_predicts_fewer_preemptions(fit: object, seed: int) -> None:
    from kvtune.core.workload_fit import FittedWorkload

    assert isinstance(fit, FittedWorkload)
    values = max_num_seqs_candidates(fit, count=8)
    table = what_if(fit, [Candidate(v) for v in values], seed=seed, horizon=SHORT)
    rates = [p.preemptions_per_min for p in table]
    assert rates == sorted(rates)
    raw = [p.raw_preemptions_per_min for p in table]
    assert sum(r * p.simulated_s for r, p in zip(rates, table, strict=True)) == pytest.approx(
        sum(r * p.simulated_s for r, p in zip(raw, table, strict=True))
    )  # smoothing moves preemptions between neighbours, it never invents or hides any


@settings(max_examples=12, deadline=None)
@given(fit=workloads, seed=st.integers(0, 100))
def test_fp8_never_preempts_where_16_bits_does_not(fit: object, seed: int) -> None:
    """(Where both preempt, FP8 may preempt more per minute: twice the residents fill the pool again.)"""
    from kvtune.core.workload_fit import FittedWorkload

    assert isinstance(fit, FittedWorkload)
    table = what_if(fit, standard_candidates(fit, count=6), seed=seed, horizon=SHORT)
    sixteen = {p.candidate.max_num_seqs: p for p in predictions_for(table, fp8=False)}
    for p in predictions_for(table, fp8=True):
        if sixteen[p.candidate.max_num_seqs].preemptions_per_min == 0:
            assert p.preemptions_per_min == 0


def test_shared_runs_are_the_runs_they_stand_for() -> None:
    """A run max_num_seqs never held back is the run of every larger value; an FP8 run whose 16-bit twin
    never ran out of memory is that twin; a closed loop never runs more than its clients."""
    unbound = simulate(DEFAULT, Candidate(6), horizon=SHORT)
    assert unbound.seqs_bound and not unbound.memory_bound
    fp8 = simulate(DEFAULT, Candidate(6, fp8=True), horizon=SHORT)
    assert (fp8.tokens, fp8.steps, fp8.preemptions, fp8.sequence_steps) == (
        unbound.tokens, unbound.steps, unbound.preemptions, unbound.sequence_steps,
    )  # fmt: skip
    assert fp8.peak_kv_usage == pytest.approx(unbound.peak_kv_usage / 2)  # the same slots, of twice the pool
    at_clients = simulate(DEFAULT, Candidate(16), horizon=SHORT)
    assert not at_clients.seqs_bound  # 16 clients: 16 slots never hold anyone back
    assert effective(DEFAULT, Candidate(64)) == Candidate(16)
    for larger in (17, 40):
        run = simulate(DEFAULT, Candidate(larger), horizon=SHORT)
        assert replace(run, candidate=Candidate(16)) == at_clients
    table = what_if(DEFAULT, [Candidate(6, fp8=True), Candidate(6), Candidate(64)], horizon=SHORT)
    assert table[0] == replace(fp8, preemptions_per_min=table[0].preemptions_per_min)
    assert table[2].candidate == Candidate(64) and table[2].tokens == at_clients.tokens


def test_the_risk_margin_is_exact_a_run_that_held_less_is_the_same_run_in_a_smaller_pool() -> None:
    run = simulate(DEFAULT, Candidate(7), horizon=SHORT)
    assert run.preemptions == 0 and 0.5 < run.peak_kv_usage < 1
    block = DEFAULT.settings.block_size
    smaller_pool = math.ceil(run.peak_kv_usage * DEFAULT.settings.pool_tokens / block) * block
    smaller = replace(DEFAULT, settings=replace(DEFAULT.settings, pool_tokens=smaller_pool))
    again = simulate(smaller, Candidate(7), horizon=SHORT)
    assert (again.preemptions, again.tokens, again.steps, again.sequence_steps, again.prefill_tokens) == (
        0, run.tokens, run.steps, run.sequence_steps, run.prefill_tokens,
    )  # fmt: skip
    tighter = replace(DEFAULT, settings=replace(DEFAULT.settings, pool_tokens=smaller_pool - 4 * block))
    assert simulate(tighter, Candidate(7), horizon=SHORT).peak_kv_usage == 1.0  # below it the run changes


def test_goodput_under_another_step_model_is_the_run_under_that_model() -> None:
    other = StepTimeModel(0.004, 0.0015, 5e-5, "other")
    run = simulate(DEFAULT, Candidate(9), horizon=SHORT)
    rerun = simulate(replace(DEFAULT, step_time=other), Candidate(9), horizon=SHORT)
    assert run.goodput_under(other) == pytest.approx(rerun.goodput, rel=1e-9)
    assert run.goodput_under(DEFAULT.step_time) == pytest.approx(run.goodput, rel=1e-9)


def test_a_cap_shortens_outputs_and_fp8_doubles_a_16_bit_pool() -> None:
    free = simulate(DEFAULT, Candidate(12), horizon=SHORT)
    capped = simulate(DEFAULT, Candidate(12, max_tokens_cap=60), horizon=SHORT)
    assert capped.preemptions < free.preemptions
    assert capped.finished > free.finished  # shorter answers, more of them
    assert fp8_pool_factor("auto") == 2 and fp8_pool_factor("bfloat16") == 2 and fp8_pool_factor("fp8") == 1
    fp8 = simulate(DEFAULT, Candidate(12, fp8=True), horizon=SHORT)
    assert fp8.preemptions == 0 and fp8.peak_kv_usage < 0.75


def test_an_open_loop_beyond_capacity_is_flagged_and_its_queue_wait_grows_with_the_rate() -> None:
    light = replace(DEFAULT, arrival=Arrival(None, 2.0, "test"))
    heavy = replace(DEFAULT, arrival=Arrival(None, 40.0, "test"))
    calm = simulate(light, Candidate(8), horizon=SHORT)
    flooded = simulate(heavy, Candidate(8), horizon=replace(SHORT, max_waiting=64))
    assert not calm.overloaded and flooded.overloaded
    assert flooded.p95_queue_wait_s > calm.p95_queue_wait_s
    assert calm.goodput == pytest.approx(2.0 * DEFAULT.output_len.observed_mean, rel=0.25)  # it keeps up


def test_a_prefix_hit_share_saves_prompt_computation() -> None:
    shared = replace(DEFAULT, prefix_hit_share=0.5)
    plain = simulate(DEFAULT, Candidate(8), horizon=SHORT)
    cached = simulate(shared, Candidate(8), horizon=SHORT)
    assert cached.prefill_tokens < 0.75 * plain.prefill_tokens


def test_candidates_respect_rounding_and_the_clients() -> None:
    assert all(v % 8 == 0 for v in max_num_seqs_candidates(DEFAULT, round_to=8))
    values = max_num_seqs_candidates(DEFAULT)
    assert max(values) == 16 and min(values) >= 1  # never above the 16 clients of the closed loop
    rows = standard_candidates(DEFAULT)
    assert len(rows) == 2 * len(values) and {c.fp8 for c in rows} == {False, True}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0.1, 10)), min_size=1, max_size=12))
def test_isotonic_regression_is_non_decreasing_keeps_the_weighted_total_and_leaves_sorted_input_alone(
    pairs: list[tuple[float, float]],
) -> None:
    values, weights = [v for v, _ in pairs], [w for _, w in pairs]
    out = isotonic(values, weights)
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(out))
    assert sum(o * w for o, w in zip(out, weights, strict=True)) == pytest.approx(
        sum(v * w for v, w in zip(values, weights, strict=True)), rel=1e-9, abs=1e-9
    )
    ordered = sorted(values)
    assert isotonic(ordered, weights) == pytest.approx(ordered)


def test_pooled_seeds_add_up_and_the_edge_is_decided_on_all_of_them() -> None:
    runs = [simulate(DEFAULT, Candidate(10), seed=s, horizon=SHORT) for s in (0, 1)]
    both = pooled(runs)
    assert both.seeds == 2 and both.tokens == runs[0].tokens + runs[1].tokens
    assert both.preemptions == runs[0].preemptions + runs[1].preemptions
    assert both.preemption_steps == (
        *runs[0].preemption_steps,
        *(runs[0].steps + s for s in runs[1].preemption_steps),
    )
    assert both.peak_kv_usage == max(r.peak_kv_usage for r in runs)
    assert simulate_seeds(DEFAULT, Candidate(10), seed=0, seeds=2, horizon=SHORT) == both
    table = predictions_for(decision_table(DEFAULT, horizon=SHORT), fp8=False)
    pick = no_preemption(table)
    assert pick.prediction is not None and pick.prediction.seeds == EDGE_SEEDS
    above = next(p for p in table if p.candidate.max_num_seqs == pick.max_num_seqs + 1)
    assert above.seeds == EDGE_SEEDS and not above.safe(DEFAULT_RISK_MARGIN)


@settings(max_examples=12, deadline=None)
@given(fit=workloads, seed=st.integers(0, 100), fp8=st.booleans())
def test_every_prediction_is_physically_possible(fit: object, seed: int, fp8: bool) -> None:
    """Whatever the workload: a preemption needs a full pool, no run holds more than the pool or runs
    more than max_num_seqs, a safe pick never preempts, and waits and rates are never negative."""
    from kvtune.core.workload_fit import FittedWorkload

    assert isinstance(fit, FittedWorkload)
    for value in max_num_seqs_candidates(fit, count=5):
        p = simulate(fit, Candidate(value, fp8=fp8), seed, SHORT)
        assert p.preemptions >= 0 and p.preemptions_per_min >= 0 and p.p95_queue_wait_s >= 0
        assert p.preemptions == len(p.preemption_steps)
        assert 0 < p.peak_kv_usage <= 1
        assert p.running_mean <= value + 1e-9
        assert p.goodput > 0 and p.tokens <= p.sequence_steps
        if p.preemptions:
            assert p.memory_bound
        if p.safe(0.0):
            assert p.preemptions == 0
