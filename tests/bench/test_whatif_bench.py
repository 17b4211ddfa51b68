"""The what-if benchmark's bookkeeping: vLLM's buckets from kvtune's, a stored window read back, how a
prediction is compared with what was observed, and the sweep-best it judges the picks against."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from kvtune.bench.sweep import Sweep, Window, confirmed_best
from kvtune.bench.whatif_report import Compared, compare, replay_verdict, shape_errors, workload_lines
from kvtune.bench.whatif_window import VLLM_SIZE_BOUNDS, coarsen, window_from_json
from kvtune.core.bucketed_lengths import Buckets
from kvtune.core.whatif import Candidate, Prediction
from kvtune.core.workload_fit import fit_workload
from kvtune.engine.http.metrics import size_buckets
from tests.core.workloads import histogram, uniform_lengths, window


def test_kvtune_buckets_coarsen_to_vllms_within_half_a_percent() -> None:
    values = uniform_lengths(1, 500, (1, 3000))
    fine = histogram(values, size_buckets(4096))
    coarse = coarsen(fine)
    assert coarse is not None
    exact = histogram(values, [b for b in VLLM_SIZE_BOUNDS if b <= 4096])
    for (bound, got), (same, want) in zip(coarse.cumulative, exact.cumulative, strict=True):
        assert bound == same
        assert got == pytest.approx(want, rel=0.01, abs=2)  # 500 read at 501, 2000 at 1995
    assert (coarse.count, coarse.total) == (fine.count, fine.total)
    with pytest.raises(ValueError, match="no bound near"):
        coarsen(Buckets(((3.0, 1.0), (7.0, 2.0), (math.inf, 2.0)), 2.0, 10.0))


def test_a_stored_window_reads_back_to_the_same_fit() -> None:
    original = window(uniform_lengths(1, 200, (200, 400)), uniform_lengths(2, 200, (100, 200)))
    stored = json.loads(json.dumps(asdict(original)))
    assert window_from_json(stored) == original
    assert fit_workload(window_from_json(stored)) == fit_workload(original)


def _result(prediction: Prediction, observed: float, seen_goodput: float) -> dict[str, object]:
    windows = {"max_num_seqs": 8, "seconds": 6.0, "goodput": seen_goodput, "per_cpu_s": 2 * seen_goodput,
               "preemptions": observed / 2}  # fmt: skip
    return {
        "predicted": [asdict(prediction)],
        "fit_cpu_share": 0.5,
        "rising": [windows],
        "falling": [windows],
    }


def _prediction(preemption_steps: tuple[int, ...]) -> Prediction:
    """1,000 measured steps at 10 tokens a step and 1,000 tokens/s: 100 steps a second."""
    return Prediction(Candidate(8), len(preemption_steps), len(preemption_steps) * 6.0, 1000.0, 1.0, 10.0, 1.0,
                      10.0, 100, steps=1000, tokens=10_000, preemption_steps=preemption_steps)  # fmt: skip


def test_a_prediction_is_judged_in_steps_of_its_run_with_its_own_bursts() -> None:
    """A machine twice as slow in the windows halves the steps they span; a burst of preemptions leaves
    most windows clear, which a rate would hide."""
    burst = _prediction(tuple(range(500, 510)))  # ten preemptions, all within ten steps
    (row,) = compare(_result(burst, observed=0, seen_goodput=500.0))
    assert isinstance(row, Compared)
    # each 6 s window at 500 tokens/s spans 300 steps; those starting at 201..509 (309 of 701) hold the burst
    assert row.chance == pytest.approx(1 - (1 - 309 / 701) ** 2)
    assert row.expected_in_span == pytest.approx(10 / 10_000 * 6_000)  # 6 expected, yet ...
    assert row.chance > 0.5 and not row.agrees  # ... zero seen where one was more likely than not
    spread = _prediction((100, 900))
    (calm,) = compare(_result(spread, observed=0, seen_goodput=100.0))  # 60-step windows
    assert calm.chance < 0.5 and calm.agrees and not calm.agrees_plain
    assert calm.goodput_error == pytest.approx(9.0)
    assert calm.per_cpu_error == pytest.approx(1000 / 0.5 / 200 - 1)
    clean = _prediction(())
    assert compare(_result(clean, observed=0, seen_goodput=500.0))[0].agrees
    assert not compare(_result(clean, observed=3, seen_goodput=500.0))[0].agrees


def test_the_chance_of_a_preemption_counts_window_positions() -> None:
    prediction = _prediction((10, 11, 500))
    assert prediction.chance_of_preemption(1) == pytest.approx(3 / 1000)
    # windows of 100: those starting at 0..11 or 401..500 hold one (112 of 901 positions)
    assert prediction.chance_of_preemption(100) == pytest.approx(112 / 901)
    assert prediction.chance_of_preemption(2000) == pytest.approx(1 - math.exp(-3 / 1000 * 2000))
    assert _prediction(()).chance_of_preemption(100) == 0.0


def test_the_shape_error_divides_out_a_common_scale() -> None:
    def row(predicted: float, observed: float) -> Compared:
        return Compared(8, 0.0, 0.0, 0.0, 0.0, 12.0, predicted, observed, predicted, observed)

    rows = [row(1300, 1000), row(1300, 1000), row(1430, 1000)]  # 30% high everywhere, one 10% more
    assert [round(e, 6) for e in shape_errors(rows)] == [0.0, 0.0, 0.1]


def test_a_clean_looking_sweep_best_that_preempts_in_its_long_window_is_replaced_and_its_neighbours_confirmed() -> (
    None
):
    def w(value: int, goodput: float, preemptions: float, seconds: float = 6.0) -> Window:
        return Window(value, seconds, goodput, goodput, preemptions, None, 1.0)

    # 9's two short windows missed its rare preemptions; 10 preempts plainly
    rising = [w(7, 1300, 0), w(8, 1450, 0), w(9, 1600, 0), w(10, 1700, 4)]
    sweep = Sweep(passes={r.max_num_seqs: [r, w(r.max_num_seqs, r.goodput, r.preemptions)] for r in rising})
    long_window = {7: 0.0, 8: 0.0, 9: 3.0}
    asked: list[int] = []

    def measure(value: int, seconds: float, label: str) -> Window:
        assert (seconds, label) == (60.0, "confirm")
        asked.append(value)
        return w(value, 1500, long_window[value], seconds=seconds)

    assert sweep.best() == 9
    assert confirmed_best(sweep, measure, 6.0, 60.0, neighbours=True) == 8
    assert asked == [8, 9, 7]  # around 9 first (10 already preempted), then around the new best, 8
    assert all(value in sweep.confirmed for value in (7, 8, 9)) and 10 not in sweep.confirmed
    assert sweep.dropped == [(9, 3.0, "its 60 s confirming window")]


def test_a_run_whose_sweep_all_preempted_reports_the_values_below_it_and_never_a_ratio_of_nothing() -> None:
    """A stored result where no value of the sweep stayed clean: the report names the value found below it,
    and one where even 1 preempted says so instead of printing "None"."""
    window = {"max_num_seqs": 2, "seconds": 6.0, "goodput": 500.0, "per_cpu_s": 1000.0, "preemptions": 3.0,
              "point": None, "cpu_share": 0.5}  # fmt: skip
    clean = {**window, "max_num_seqs": 1, "preemptions": 0.0}
    result = {
        "workload": {"name": "pool-6144-clients-24-prompts-100-2400-outputs-20-1200", "kv_cache_tokens": 6144,
                     "clients": 24, "prompt_len": [100, 2400], "output_len": [20, 1200], "start": 128,
                     "sweep": [2]},
        "fit": "a fit", "step_time": "a step", "window": asdict(window_of_lengths()), "fit_cpu_share": 0.5,
        "predicted": [asdict(_prediction((100,)))], "predicted_coarse": [asdict(_prediction((100,)))],
        "rising": [window], "falling": [window], "below": {"1": [clean, clean]}, "confirmed": {"1": clean},
        "sweep_best": 1, "picks": [[0.0, 1, "a reason", 0.0]], "rounds": {},
        "timing": {"candidates": 3.0, "wall_s": 0.1, "cpu_s": 0.1}, "load": [[1.0], [1.0]], "minutes": 1.0,
        "requests": {"completed": 10, "failed": 0},
    }  # fmt: skip
    result["predicted"][0]["candidate"]["max_num_seqs"] = 2
    result["predicted_coarse"][0]["candidate"]["max_num_seqs"] = 2
    text = "\n".join(workload_lines(result))
    assert "Sweep-best 1 (none of the sweep stayed clean; below it: 1 (0 preemptions))" in text
    assert "nan" not in text and "None" not in text
    assert replay_verdict(result).wall == 1.0  # the pick is the sweep-best found below the sweep
    nothing = {**result, "sweep_best": None, "below": {"1": [window, window]}, "confirmed": {}}
    text = "\n".join(workload_lines(nothing))
    assert "Sweep-best none: no value of the sweep nor below it, down to 1, stayed clean" in text
    assert "nan" not in text and "None" not in text


def window_of_lengths() -> object:
    return window(uniform_lengths(1, 200, (200, 400)), uniform_lengths(2, 200, (100, 200)))
