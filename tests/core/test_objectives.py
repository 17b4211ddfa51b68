"""The two objectives and the rounding, over what-if tables."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtune.core.objectives import default_round_to, goodput, no_preemption, round_down
from kvtune.core.whatif import Candidate, Horizon, Prediction, decision_table, predictions_for
from tests.core.workloads import fitted

SHORT = Horizon(warmup_lifetimes=1.0, measured_lifetimes=3.0, min_measured_steps=200)


def row(value: int, per_min: float, peak: float, goodput_: float, wait: float = 1.0) -> Prediction:
    return Prediction(Candidate(value), int(per_min), per_min, goodput_, wait, value, peak, 60.0, 100)


TABLE = [
    row(4, 0, 0.50, 380, wait=6.0),
    row(6, 0, 0.72, 450, wait=4.0),
    row(8, 0, 0.94, 482, wait=3.0),
    row(9, 0, 0.99, 480, wait=2.8),  # clean in its run, but it held 99% of the pool
    row(10, 6, 1.0, 559, wait=2.5),
    row(12, 20, 1.0, 601, wait=2.4),
    row(16, 20, 1.0, 557, wait=2.4),
]


def test_no_preemption_takes_the_largest_clean_value_within_the_margin() -> None:
    assert no_preemption(TABLE, risk_margin=0.05).max_num_seqs == 8
    assert no_preemption(TABLE, risk_margin=0.0).max_num_seqs == 9
    assert no_preemption(TABLE, risk_margin=0.4).max_num_seqs == 4
    assert no_preemption(TABLE, risk_margin=0.6).prediction is None
    assert no_preemption(TABLE, round_to=8).max_num_seqs == 8
    assert no_preemption(TABLE[4:]).prediction is None
    with pytest.raises(ValueError):
        no_preemption(TABLE, risk_margin=1.0)


def test_goodput_takes_the_best_within_the_wait_bound_preempting_or_not() -> None:
    """The issue's example: 601 tokens/s at 12 with 20 preemptions, against 482 at 8 with none."""
    assert goodput(TABLE, p95_wait_bound_s=10).max_num_seqs == 12
    assert goodput(TABLE, p95_wait_bound_s=3.0).max_num_seqs == 12
    assert goodput(TABLE, p95_wait_bound_s=10, round_to=8).max_num_seqs == 16
    slow = [replace(p, p95_queue_wait_s=p.p95_queue_wait_s + 10) for p in TABLE]
    assert goodput(slow, p95_wait_bound_s=5).prediction is None
    flooded = [replace(p, overloaded=p.candidate.max_num_seqs == 12) for p in TABLE]
    assert goodput(flooded, p95_wait_bound_s=10).max_num_seqs == 10


def test_rounding_is_8_for_vllm_on_cuda_and_1_elsewhere() -> None:
    assert default_round_to("vllm", "cuda") == 8
    assert default_round_to("vLLM", "CUDA") == 8
    assert default_round_to("vllm", "cpu") == 1
    assert default_round_to("kvtune", "cuda") == 1
    assert [round_down(v, 8) for v in (3, 8, 15, 16, 23)] == [8, 8, 8, 16, 16]
    assert round_down(7, 1) == 7
    with pytest.raises(ValueError):
        round_down(7, 0)


def test_the_decision_table_knows_the_edge_to_one_step_and_rounds() -> None:
    fit = fitted(pool_tokens=8192, in_system=(40,) * 13)  # capacity 18, 40 clients: a coarse first pass
    table = decision_table(fit, horizon=SHORT)
    sixteen = predictions_for(table, fp8=False)
    pick = no_preemption(sixteen)
    assert pick.max_num_seqs is not None
    values = [p.candidate.max_num_seqs for p in sixteen]
    assert pick.max_num_seqs + 1 in values  # the value just above the pick was simulated, and is not safe
    above = next(p for p in sixteen if p.candidate.max_num_seqs == pick.max_num_seqs + 1)
    assert not above.safe(0.05)
    eights = decision_table(fit, round_to=8, horizon=SHORT)
    assert all(p.candidate.max_num_seqs % 8 == 0 for p in eights)
    fp8 = no_preemption(predictions_for(table, fp8=True))
    assert fp8.max_num_seqs is not None and fp8.max_num_seqs > pick.max_num_seqs
