"""Windows (rates, counter resets, histogram deltas) and the pure diagnosis on recorded and synthetic data."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.contract import metrics as m
from kvtune.operator.decide.diagnosis import diagnose, pooled_p95_concurrency
from kvtune.operator.decide.sample import Sample, engine_view_from_sample
from kvtune.operator.decide.window import Window, histogram_quantile
from tests.operator.helpers import cumulative, kvtune_engine, recorded, synthetic


def recorded_window() -> tuple[Window, Sample]:
    t0, t1 = recorded("kvtune_preempting_t0.prom", 100.0), recorded("kvtune_preempting_t1.prom", 110.0)
    assert isinstance(t0, Sample) and isinstance(t1, Sample)
    return Window.of([t1, t0]), t1


def test_recorded_preempting_window() -> None:
    window, latest = recorded_window()
    engine = engine_view_from_sample(latest)
    assert (engine.max_num_seqs, engine.pool_tokens, engine.max_model_len) == (64, 1024, 1024)
    d = diagnose(window, engine)
    assert d.status == "active"
    assert d.preemptions == 49 and d.preemption_rate == pytest.approx(4.9)
    assert d.goodput == pytest.approx((9665 - 4941) / 10)
    assert d.generation_len is not None and d.generation_len.since == "this window"
    assert 100 < d.generation_len.p95 <= 200
    assert d.footprint_p95 is not None and 250 < d.footprint_p95 < 300
    assert d.real_concurrency_ceiling == 3
    # Means are exact (histogram sums), so the mean footprint carries no bucket interpolation.
    assert d.prompt_len is not None and d.prompt_len.mean == pytest.approx(59.3)
    assert d.generation_len.mean == pytest.approx(118.1)
    assert d.footprint_mean == pytest.approx(177.4) and d.mean_footprint_concurrency == 5
    assert d.boot_line_concurrency == pytest.approx(1.0)
    codes = {f.code for f in d.findings}
    assert {"Preempting", "ConcurrencyCeiling"} <= codes


def test_counter_reset_counts_from_zero() -> None:
    samples = [synthetic(0, preemptions=100, generated=5000), synthetic(10, preemptions=120, generated=6000),
               synthetic(20, preemptions=5, generated=300), synthetic(30, preemptions=9, generated=900)]  # fmt: skip
    window = Window.of(samples)
    assert window.restarts() == 1
    assert window.increase(m.PREEMPTIONS) == 20 + 5 + 4
    assert window.rate(m.GENERATION_TOKENS) == pytest.approx((1000 + 300 + 600) / 30)
    d = diagnose(window, kvtune_engine())
    assert any(f.code == "EngineRestarted" for f in d.findings)
    assert d.preemption_rate == pytest.approx(29 / 30)


def test_histogram_delta_and_reset() -> None:
    a = cumulative([(10.0, 5), (100.0, 5), (float("inf"), 0)])
    b = cumulative([(10.0, 6), (100.0, 9), (float("inf"), 1)])
    c = cumulative([(10.0, 1), (100.0, 0), (float("inf"), 0)])  # after a restart
    samples = [Sample(t, histograms={"h": h}) for t, h in ((0, a), (1, b), (2, c))]
    delta = Window.of(samples).histogram_delta("h")
    assert delta is not None
    assert dict(delta.buckets) == {10.0: 2, 100.0: 6, float("inf"): 7}
    assert delta.count == 7


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    h = cumulative([(100.0, 0), (200.0, 100), (float("inf"), 0)])
    assert histogram_quantile(0.5, h) == pytest.approx(150)
    assert histogram_quantile(0.99, h) == pytest.approx(199)
    tail = cumulative([(100.0, 50), (float("inf"), 50)])
    assert histogram_quantile(0.9, tail) == 100  # +Inf bucket: the highest finite bound
    assert histogram_quantile(0.5, cumulative([(1.0, 0)])) is None


def test_zero_traffic_window_is_idle_with_no_findings_to_act_on() -> None:
    quiet = [synthetic(t, preemptions=7, generated=1000, kv=0.0, running=0) for t in (0, 5, 10)]
    d = diagnose(Window.of(quiet), kvtune_engine())
    assert d.status == "idle"
    assert d.preemption_rate == 0 and not d.preempting
    assert d.generation_len is not None and d.generation_len.since == "since engine start"


def test_empty_window_is_no_data() -> None:
    assert diagnose(Window(()), kvtune_engine()).status == "no_data"


def test_hit_rate_prefers_tokens_by_source() -> None:
    def sample(t: float, hits: float, queries: float, local: float, computed: float) -> Sample:
        return Sample(t, counters={
            m.PREFIX_HITS: hits, m.PREFIX_QUERIES: queries,
            f"{m.PROMPT_TOKENS_BY_SOURCE}:local_cache_hit": local,
            f"{m.PROMPT_TOKENS_BY_SOURCE}:local_compute": computed,
        })  # fmt: skip

    window = Window.of([sample(0, 0, 0, 0, 0), sample(10, 900, 1000, 100, 900)])
    d = diagnose(window, kvtune_engine())
    assert d.prefix_hit_rate == pytest.approx(0.1)
    assert d.prefix_hit_rate_source == "prompt_tokens_by_source"
    legacy = Window.of([Sample(0, counters={m.PREFIX_HITS: 0, m.PREFIX_QUERIES: 0}),
                        Sample(10, counters={m.PREFIX_HITS: 300, m.PREFIX_QUERIES: 1000})])  # fmt: skip
    assert diagnose(legacy, kvtune_engine()).prefix_hit_rate == pytest.approx(0.3)


def test_sglang_window_diagnoses_retractions() -> None:
    from tests.operator.sources_world import SGLANG

    later = SGLANG.replace('_total{model_name="m"} 7', '_total{model_name="m"} 27')
    a, b = (recorded_text(text, t) for text, t in ((SGLANG, 0.0), (later, 10.0)))
    d = diagnose(Window.of([a, b]), engine_view_from_sample(b))
    assert d.preemption_rate == pytest.approx(2.0)
    assert d.kv_usage_max == pytest.approx(0.93)
    assert d.saturated
    assert d.prefix_hit_rate == pytest.approx(0.41)  # SGLang's gauge when no counter moved


def recorded_text(text: str, t: float) -> Sample:
    from tests.operator.helpers import parse_exposition

    sample = parse_exposition(text, t, "sglang")
    assert isinstance(sample, Sample)
    return sample


@given(
    pool=st.floats(min_value=1, max_value=1e7),
    mean=st.floats(min_value=1, max_value=1e5),
    excess=st.floats(min_value=0, max_value=1e5),
)
def test_pooled_p95_sizing_lies_between_the_p95_and_the_mean_sizing(
    pool: float, mean: float, excess: float
) -> None:
    p95 = mean + excess
    pooled = pooled_p95_concurrency(pool, mean, p95)
    assert pooled is not None and pooled >= 1
    assert max(1, math.floor(pool / p95)) <= pooled <= max(1, math.floor(pool / mean))
    if pooled > 1 or pool >= p95:
        # the largest count whose total's p95 fits: it fits, one more does not
        assert pooled * mean + math.sqrt(pooled) * excess <= pool * (1 + 1e-12)
    assert (pooled + 1) * mean + math.sqrt(pooled + 1) * excess > pool * (1 - 1e-12)


def test_pooled_p95_sizing_anchors() -> None:
    assert pooled_p95_concurrency(300, 225, 292) == 1  # one resident: pool / p95
    assert pooled_p95_concurrency(4096, 225, 292) == 16
    assert pooled_p95_concurrency(4096, 225, 200) == 18  # p95 under the mean: no spread, pool / mean
    assert pooled_p95_concurrency(4096, None, 292) is None
