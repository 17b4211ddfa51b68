"""Pooling many pods' samples into one: counters from per-pod deltas never fall whatever pods come, go or
restart, and their pooled increase is exactly the pods' real work; gauges pool by what the diagnosis
compares them to; pods that disagree on their cache config are a finding; the worst pod is named."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.contract import metrics as m
from kvtune.operator.decide.pooling import PoolState, evidence, histograms_due, pool, worst_pod_line
from kvtune.operator.decide.sample import Histogram, Sample
from kvtune.operator.decide.window import Window

HORIZON = 1e9
BOUNDS = (100.0, 500.0, float("inf"))


def pod_sample(t: float, preemptions: float, started: float, *, kv: float = 0.5, running: float = 4.0,
               waiting: float = 0.0, pool_tokens: str = "8192", finished: float | None = None) -> Sample:  # fmt: skip
    """One pod's scrape: its counters, a footprint histogram whose count is `finished`, gauges, config."""
    done = preemptions if finished is None else finished
    histogram = Histogram(tuple((bound, done) for bound in BOUNDS), done, 50.0 * done)
    return Sample(
        timestamp=t,
        gauges={m.KV_USAGE: kv, m.RUNNING: running, m.WAITING: waiting, m.PROCESS_START: started},
        counters={m.PREEMPTIONS: preemptions, m.GENERATION_TOKENS: 10 * preemptions},
        histograms={m.REQUEST_GENERATION_TOKENS: histogram},
        cache_config={"block_size": "16", "kv_cache_size_tokens": pool_tokens},
    )


# one pod's fate at one tick: absent (gone, or not yet there), or there having done `work` since the last
# tick, possibly after a restart just before it
Fate = tuple[bool, int, bool]  # (present, work, restarted)
fates = st.tuples(st.booleans(), st.integers(0, 50), st.booleans())
runs = st.lists(st.lists(fates, min_size=4, max_size=4), min_size=2, max_size=8)


@dataclass
class SimulatedPod:
    value: int
    started: float


@settings(max_examples=300, deadline=None)
@given(runs)
def test_pooled_counters_never_fall_and_grow_by_the_pods_real_work(run: list[list[Fate]]) -> None:
    state = PoolState()
    alive: dict[str, SimulatedPod] = {}
    pooled: list[Sample] = []
    for tick, pods in enumerate(run):
        now = 10.0 * (tick + 1)
        real_work = 0
        for index, (present, work, restarted) in enumerate(pods):
            name = f"pod-{index}"
            if not present:
                alive.pop(name, None)  # gone: a pod of that name later is a new process
                continue
            pod = alive.get(name)
            if pod is None or restarted:  # new, or restarted just after the last tick: counts from zero
                alive[name] = pod = SimulatedPod(0, now - 1.0)
            pod.value += work
            real_work += work
        readings = {name: pod_sample(now, pod.value, pod.started) for name, pod in alive.items()}
        result = pool(state, readings, set(readings), now, HORIZON)
        state = result.state
        if pooled:
            previous = pooled[-1]
            grown = result.sample.counters.get(m.PREEMPTIONS, 0.0) - previous.counters.get(m.PREEMPTIONS, 0.0)
            assert grown == real_work
            assert result.sample.counters.get(m.GENERATION_TOKENS, 0) >= previous.counters.get(
                m.GENERATION_TOKENS, 0
            )
            histogram = result.sample.histograms.get(m.REQUEST_GENERATION_TOKENS)
            before = previous.histograms.get(m.REQUEST_GENERATION_TOKENS)
            if histogram is not None and before is not None:
                assert histogram.count - before.count == real_work
                assert all(a <= b for (_, a), (_, b) in zip(before.buckets, histogram.buckets, strict=True))
        pooled.append(result.sample)
    window = Window.of(pooled)
    assert window.restarts() == 0  # pods coming, going, restarting: never a workload restart
    grown = window.increase(m.PREEMPTIONS)
    assert grown is None or grown >= 0


def without_histograms(sample: Sample) -> Sample:
    return replace(sample, histograms={})


@settings(max_examples=300, deadline=None)
@given(runs, st.lists(st.booleans(), min_size=8, max_size=8))
def test_histograms_read_only_at_some_ticks_are_never_counted_twice(
    run: list[list[Fate]], carried: list[bool]
) -> None:
    """Between two reads that carry histograms (issue 38: most of a pod's series are buckets) each pod keeps
    its last ones: the pooled histogram never falls, and grows at the next read by the pods' real work
    since the last one, all of it when no pod restarted or went in between (their work on the ticks
    between is not seen: a restart zeroes what was not read). A new pod is read whole at once, as the
    Prometheus source does."""
    state = PoolState()
    alive: dict[str, SimulatedPod] = {}
    read_at: Histogram | None = None
    work_since, whole = 0, True
    for tick, pods in enumerate(run):
        now = 10.0 * (tick + 1)
        for index, (present, work, restarted) in enumerate(pods):
            name = f"pod-{index}"
            if not present:
                whole = whole and name not in alive
                alive.pop(name, None)
                continue
            pod = alive.get(name)
            if pod is None or restarted:
                whole = whole and pod is None
                alive[name] = pod = SimulatedPod(0, now - 1.0)
            pod.value += work
            work_since += work
        readings = {name: pod_sample(now, pod.value, pod.started) for name, pod in alive.items()}
        full = tick == 0 or carried[tick] or not set(readings) <= set(state.pods)
        if not full:
            readings = {name: without_histograms(sample) for name, sample in readings.items()}
        result = pool(state, readings, set(readings), now, HORIZON)
        histogram = result.sample.histograms.get(m.REQUEST_GENERATION_TOKENS)
        assert (result.state.histograms_at == now) == (full and bool(readings))
        if full and histogram is not None:
            if read_at is not None:
                grown = histogram.count - read_at.count
                assert grown == work_since if whole else 0 <= grown <= work_since
            read_at, work_since, whole = histogram, 0, True
        elif not full:
            assert histogram == (state.histograms.get(m.REQUEST_GENERATION_TOKENS))
        state = result.state


def test_histograms_are_due_at_the_first_read_then_once_a_period_spread_by_up_to_half() -> None:
    assert histograms_due(PoolState(), 0.0, 60.0, 15.0)
    for at in (1000.0, 1000.25, 1000.499, 1000.75):
        state = PoolState(at=at, histograms_at=at)
        spread = 60.0 * (1.0 + (int(at * 1000) % 500) / 1000)
        assert 60.0 <= spread < 90.0
        assert not histograms_due(state, at + spread - 7.6, 60.0, 15.0)
        assert histograms_due(state, at + spread - 7.5, 60.0, 15.0)  # to the nearest interval


def test_a_pod_first_seen_later_brings_its_whole_counter_and_a_gone_pod_is_dropped() -> None:
    first = pool(
        PoolState(), {"a": pod_sample(10, 40, 1), "b": pod_sample(10, 5, 1)}, {"a", "b"}, 10, HORIZON
    )
    assert first.sample.counters[m.PREEMPTIONS] == 45  # the first sample: everything since boot
    # b is replaced by c (started after the first sample, 3 preemptions since), a preempts 10 more
    second = pool(first.state, {"a": pod_sample(20, 50, 1), "c": pod_sample(20, 3, 15)}, {"a", "c"}, 20,
                  HORIZON)  # fmt: skip
    assert second.sample.counters[m.PREEMPTIONS] == 45 + 10 + 3
    assert (second.new, second.gone, second.restarted) == (("c",), ("b",), ())
    assert set(second.state.pods) == {"a", "c"}


def test_a_pod_that_fell_or_moved_its_start_time_restarted() -> None:
    first = pool(PoolState(), {"a": pod_sample(10, 40, 1)}, {"a"}, 10, HORIZON)
    fell = pool(first.state, {"a": pod_sample(20, 7, 1)}, {"a"}, 20, HORIZON)
    assert fell.restarted == ("a",) and fell.sample.counters[m.PREEMPTIONS] == 47
    moved = pool(first.state, {"a": pod_sample(20, 45, 15)}, {"a"}, 20, HORIZON)
    assert moved.restarted == ("a",) and moved.sample.counters[m.PREEMPTIONS] == 85  # 45 since it started


def test_a_pod_seen_late_but_started_early_is_a_baseline() -> None:
    """A pod whose first read failed: its counters since boot cannot be placed in time, so they are not
    counted as work done since the last sample (which would be a spike of preemptions)."""
    first = pool(PoolState(), {"a": pod_sample(10, 40, 1)}, {"a"}, 10, HORIZON)
    second = pool(first.state, {"a": pod_sample(20, 41, 1), "b": pod_sample(20, 900, 2)}, {"a", "b"}, 20,
                  HORIZON)  # fmt: skip
    assert second.sample.counters[m.PREEMPTIONS] == 41
    third = pool(second.state, {"a": pod_sample(30, 41, 1), "b": pod_sample(30, 905, 2)}, {"a", "b"}, 30,
                 HORIZON)  # fmt: skip
    assert third.sample.counters[m.PREEMPTIONS] == 46


def test_an_unreadable_pod_keeps_its_memory_until_it_is_gone() -> None:
    first = pool(
        PoolState(), {"a": pod_sample(10, 40, 1), "b": pod_sample(10, 5, 1)}, {"a", "b"}, 10, HORIZON
    )
    missed = pool(first.state, {"a": pod_sample(20, 41, 1)}, {"a", "b"}, 20, HORIZON)  # b listed, not read
    assert set(missed.state.pods) == {"a", "b"} and not missed.gone
    back = pool(
        missed.state, {"a": pod_sample(30, 41, 1), "b": pod_sample(30, 8, 1)}, {"a", "b"}, 30, HORIZON
    )
    assert back.sample.counters[m.PREEMPTIONS] == 45 + 1 + 3  # b's 3 since its last read, once


def test_gauges_pool_by_what_the_diagnosis_compares_them_to() -> None:
    readings = {
        "a": pod_sample(10, 0, 1, kv=0.97, running=12, waiting=3),
        "b": pod_sample(10, 0, 2, kv=0.40, running=5, waiting=4),
    }
    gauges = pool(PoolState(), readings, set(readings), 10, HORIZON).sample.gauges
    assert gauges[m.KV_USAGE] == 0.97  # the fullest pod preempts
    assert gauges[m.RUNNING] == 12  # compared to max_num_seqs, which each pod holds
    assert gauges[m.WAITING] == 7  # the workload's whole queue
    assert m.PROCESS_START not in gauges  # a pod's restart is not the workload's


def test_pods_that_disagree_on_their_cache_config_are_a_finding_sized_from_the_smallest_pool() -> None:
    readings = {"a": pod_sample(10, 0, 1, pool_tokens="8192"), "b": pod_sample(10, 0, 1, pool_tokens="4096")}
    result = pool(PoolState(), readings, set(readings), 10, HORIZON)
    assert result.sample.cache_config["kv_cache_size_tokens"] == "4096"
    assert len(result.findings) == 1 and "a=8192, b=4096" in result.findings[0]
    agreeing = {"a": pod_sample(10, 0, 1), "b": pod_sample(10, 0, 1)}
    assert not pool(PoolState(), agreeing, set(agreeing), 10, HORIZON).findings


def test_pods_with_other_histogram_buckets_are_left_out_of_that_histogram() -> None:
    odd = pod_sample(10, 4, 1)
    odd = Sample(10, odd.gauges, odd.counters,
                 {m.REQUEST_GENERATION_TOKENS: Histogram(((64.0, 4.0), (float("inf"), 4.0)), 4.0, 9.0)})  # fmt: skip
    result = pool(PoolState(), {"a": pod_sample(10, 2, 1), "b": odd}, {"a", "b"}, 10, HORIZON)
    assert result.sample.histograms[m.REQUEST_GENERATION_TOKENS].count == 2
    assert any("b: buckets of" in finding for finding in result.findings)


def test_the_worst_pod_has_the_most_preemptions_in_the_window_then_the_fullest_kv() -> None:
    state = pool(PoolState(), {n: pod_sample(10, 10, 1) for n in "abc"}, set("abc"), 10, HORIZON).state
    readings = {
        "a": pod_sample(20, 15, 1, kv=0.99),
        "b": pod_sample(20, 30, 1, kv=0.80),
        "c": pod_sample(20, 15, 1, kv=0.90),
    }
    state = pool(state, readings, set(readings), 20, HORIZON).state
    found = evidence(state, since=10)
    assert [(e.name, e.preemptions) for e in found] == [("b", 20), ("a", 5), ("c", 5)]
    assert worst_pod_line(found[0]) == "worst pod b: 20 preemptions in the window, KV usage max 80%"
    assert [e.preemptions for e in evidence(state, since=20)] == [0, 0, 0]  # nothing after the window start
