"""A metrics source that answers from more than one process (a Service in front of several pods, a stale
replica, a relay that halves every counter for a while) is not activity: `continuity` says so, the window
never takes a rate across two processes, and the operator loop holds every action until the source has
answered from one process for a while. No sequence of such scrapes makes the operator lower a value
without preemptions in one process's own counters (a hypothesis property)."""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.cli import main
from kvtune.contract import metrics as m
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.continuity import (
    ALTERNATING,
    ALTERNATING_HINT,
    FIRST,
    RESTART,
    SAME,
    Continuity,
    judge,
)
from kvtune.operator.decide.diagnosis import diagnose
from kvtune.operator.decide.ladder import plan
from kvtune.operator.decide.loop import Tick, hold_seconds, step
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.ports import ActuatorResult
from kvtune.operator.decide.sample import Histogram, Sample, SampleResult, sample_from_series
from kvtune.operator.decide.tuner import TunerState
from kvtune.operator.decide.window import Window
from tests.operator.helpers import fixture_text, kvtune_engine, serve_bodies, synthetic

POLICY = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=2.0, cooldown_s=2.0)
HORIZON = 1e9


def of(sample: Sample, *identity: tuple[str, float]) -> Sample:
    return replace(sample, identity=tuple(sorted(identity)))


def scaled(sample: Sample, factor: float, at: float) -> Sample:
    """`sample`'s counters and histograms times `factor` (what the relay of the issue did), taken at `at`."""

    def times(h: Histogram) -> Histogram:
        return Histogram(tuple((b, c * factor) for b, c in h.buckets), h.count * factor, h.total * factor)

    return replace(
        sample,
        timestamp=at,
        counters={k: v * factor for k, v in sample.counters.items()},
        histograms={k: times(h) for k, h in sample.histograms.items()},
    )


def judged(samples: list[Sample]) -> list[str]:
    continuity, kinds = Continuity(), []
    for sample in samples:
        verdict = judge(continuity, sample, HORIZON)
        continuity = verdict.continuity
        kinds.append(verdict.kind)
    return kinds


# ---- continuity, pure ------------------------------------------------------------------------------------


def test_one_process_is_the_same_and_a_new_start_time_is_a_restart() -> None:
    a = [of(synthetic(t, preemptions=5, generated=100 * t), ("", 1000.0)) for t in range(3)]
    b = of(synthetic(3, preemptions=0, generated=10), ("", 1002.5))
    assert judged([*a, b]) == [FIRST, SAME, SAME, RESTART]


def test_a_counter_that_falls_while_the_start_time_stays_is_not_kept() -> None:
    full = of(synthetic(0, preemptions=109, generated=5000), ("", 1000.0))
    half = scaled(full, 0.5, 1.0)
    verdict = judge(judge(Continuity(), full, HORIZON).continuity, half, HORIZON)
    assert verdict.kind == ALTERNATING and not verdict.keep
    assert verdict.reason is not None and "fell" in verdict.reason and "stayed 1000.00" in verdict.reason
    # the process's marks stand: the true text coming back is the same process, not a burst
    back = judge(verdict.continuity, replace(full, timestamp=2.0), HORIZON)
    assert back.kind == SAME and back.keep


def test_a_replaced_process_that_answers_again_is_an_alternation() -> None:
    a = [of(synthetic(t, preemptions=109, generated=5000 + t), ("", 1000.0)) for t in (0, 2, 4)]
    b = [of(synthetic(t, preemptions=3, generated=80 + t), ("", 1500.0)) for t in (1, 3)]
    assert judged([a[0], b[0], a[1], b[1], a[2]]) == [FIRST, RESTART, ALTERNATING, ALTERNATING, ALTERNATING]


def test_an_older_start_time_after_a_newer_one_is_an_alternation_at_once() -> None:
    newer = of(synthetic(0, preemptions=1), ("", 2000.0))
    older = of(synthetic(1, preemptions=400), ("", 1000.0))
    verdict = judge(judge(Continuity(), newer, HORIZON).continuity, older, HORIZON)
    assert verdict.kind == ALTERNATING and verdict.reason is not None and "went back" in verdict.reason


def test_without_start_times_a_fall_is_a_restart_until_the_counters_come_back() -> None:
    full = synthetic(0, preemptions=109, generated=5000)
    half = [scaled(full, 0.5, t) for t in (1, 2)]
    later = [replace(full, timestamp=t) for t in (3.0, 4.0, 5.0)]
    assert judged([full, *half, *later]) == [FIRST, RESTART, SAME, ALTERNATING, SAME, SAME]
    # the halved stream's growing counter passing its old mark is said once; the constant one coming back
    # (the true text again) is said too, and then nothing more
    busy = [synthetic(t, preemptions=109, generated=300 * t) for t in range(0, 12)]
    relayed = [*busy[:4], *(scaled(s, 0.5, s.timestamp) for s in busy[4:9]), *busy[9:]]
    assert judged(relayed) == [FIRST, SAME, SAME, SAME, RESTART, SAME, ALTERNATING, SAME, SAME, ALTERNATING, SAME,
                               SAME]  # fmt: skip


def test_a_proxy_that_did_not_answer_is_a_partial_view_not_another_process() -> None:
    both = [
        of(synthetic(t, preemptions=5, generated=100 * t), ("", 1000.0), ("proxy", 1001.0)) for t in (0, 2)
    ]
    engine_only = of(synthetic(1, preemptions=5, generated=100), ("", 1000.0))
    restarted_proxy = of(synthetic(3, preemptions=5, generated=300), ("", 1000.0), ("proxy", 1002.9))
    assert judged([both[0], engine_only, both[1], restarted_proxy]) == [FIRST, SAME, SAME, RESTART]


def test_the_identity_comes_from_each_process_start_time_series_by_pod() -> None:
    series = [
        ("vllm:num_preemptions_total", {"pod": "a"}, 5.0),
        ("vllm:num_preemptions_total", {"pod": "b"}, 7.0),
        ("process_start_time_seconds", {"pod": "a", "job": "vllm"}, 1000.0),
        ("process_start_time_seconds", {"pod": "b", "job": "vllm"}, 1200.0),
    ]
    sample = sample_from_series(series, 1.0, "test")
    assert isinstance(sample, Sample)
    assert sample.identity == (("pod=a", 1000.0), ("pod=b", 1200.0))
    assert sample.counters[m.PREEMPTIONS] == 12


# ---- the window never takes a rate across two processes -----------------------------------------------------


def test_no_growth_is_taken_across_two_identities_or_below_a_process_marks() -> None:
    a0 = of(synthetic(0, preemptions=100, generated=5000), ("", 1000.0))
    b1 = of(synthetic(10, preemptions=900, generated=90000), ("", 500.0))
    a2 = of(synthetic(20, preemptions=100, generated=6000), ("", 1000.0))
    window = Window.of([a0, b1, a2])
    assert window.increase(m.PREEMPTIONS) == 0 and window.increase(m.GENERATION_TOKENS) == 0
    halved = Window.of([a0, scaled(a0, 0.5, 10), replace(a0, timestamp=20)])
    assert halved.increase(m.PREEMPTIONS) == 0 and halved.rate(m.PREEMPTIONS) == 0
    assert halved.histogram_delta(m.REQUEST_GENERATION_TOKENS) == Histogram(
        tuple((b, 0.0) for b, _ in a0.histograms[m.REQUEST_GENERATION_TOKENS].buckets), 0.0, 0.0
    )
    assert halved.restarts() == 0


def test_the_doctor_says_an_alternating_source_and_sizes_nothing_from_it() -> None:
    full = of(synthetic(0, preemptions=109, generated=5000, kv=0.97, running=12, waiting=4), ("", 1000.0))
    d = diagnose(Window.of([full, scaled(full, 0.5, 5.0)]), kvtune_engine())
    (found,) = [f for f in d.findings if f.code == "AlternatingSource"]
    assert ALTERNATING_HINT in found.message and "fell" in found.evidence
    assert not any(advice.applicable for advice in plan(d, kvtune_engine(), POLICY))


def test_kvtune_doctor_on_a_relay_that_halved_its_counters_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    start = "process_start_time_seconds 1700000000.0\n"
    true = fixture_text("kvtune_preempting_t1.prom") + start
    half = "\n".join(
        f"{line.rsplit(' ', 1)[0]} {float(line.rsplit(' ', 1)[1]) / 2}" if line.startswith("vllm:num_preemptions") or
        line.startswith("vllm:generation_tokens_total") else line
        for line in true.splitlines()
    ) + "\n"  # fmt: skip
    for url in serve_bodies([true, half]):
        assert main(["doctor", "--metrics-url", url, "--json", "--window-seconds", "0.2"]) == 0
    report = json.loads(capsys.readouterr().out)
    (note,) = [n for n in report["findings"]["notes"] if n["code"] == "AlternatingSource"]
    assert ALTERNATING_HINT in note["message"] and "stayed 1700000000.00" in note["evidence"]
    assert report["findings"]["preemption_rate"] == 0
    assert not any(r["applicable"] for r in report["remedies"])


# ---- the operator loop ----------------------------------------------------------------------------------------


class Engine:
    """The knobs of the engine the admin API reaches: max_num_seqs 64, no cap, until the operator acts."""

    knobs = frozenset({KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP})

    def __init__(self) -> None:
        self.values: dict[str, int | None] = {KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: None}
        self.lowered: list[tuple[str, int | str | None, int | str | None]] = []

    def current(self) -> ActuatorResult:
        return ActuatorResult(True, dict(self.values))

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        before = self.values[knob]
        if knob == KNOB_MAX_TOKENS_CAP and value is not None and (before is None or value < before):
            self.lowered.append((knob, before, value))
        if (
            knob == KNOB_MAX_NUM_SEQS
            and isinstance(value, int)
            and isinstance(before, int)
            and value < before
        ):
            self.lowered.append((knob, before, value))
        assert value is None or isinstance(value, int)
        self.values[knob] = value
        return ActuatorResult(True, dict(self.values))


class Scrapes:
    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def read(self) -> SampleResult:
        return self.samples.pop(0)


def run(samples: list[Sample]) -> tuple[Engine, list[Tick]]:
    engine, source = Engine(), Scrapes(list(samples))
    state, window, ticks = TunerState(), deque[Sample](maxlen=20), []
    for sample in samples:
        ticks.append(step(source, engine, POLICY, state, window, sample.timestamp))
        state = ticks[-1].state
    return engine, ticks


def busy(t: float, preemptions: float, start: float | None = 1000.0) -> Sample:
    """A busy engine at time t: 300 tokens/s, KV 85% full, nobody waiting (so only preemptions can make
    the operator act)."""
    sample = synthetic(t, preemptions=preemptions, generated=300 * t, kv=0.85, running=12, waiting=0)
    return of(sample, ("", start)) if start is not None else sample


@pytest.mark.parametrize("start", [1000.0, None], ids=["with-start-time", "without"])
def test_a_relay_that_halves_every_counter_for_a_while_changes_nothing(start: float | None) -> None:
    """The issue's set-up: 109 preemptions, unchanged; the relay halves every counter for 14 scrapes,
    then answers the true text again."""
    truth = [busy(float(t), 109, start) for t in range(40)]
    relayed = [scaled(s, 0.5, s.timestamp) if 10 <= s.timestamp < 24 else s for s in truth]
    engine, ticks = run(relayed)
    assert engine.lowered == [] and engine.values == {KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: None}
    said = [t for t in ticks if t.alternation]
    assert said, "the alternation is reported"
    holding = [t.at for t in ticks if t.holding]
    assert holding and max(holding) >= said[-1].at + hold_seconds(POLICY) - 1
    assert len(said) <= 16 and not ticks[-1].holding, "each flip said once; tuning resumes once it is stable"
    assert all(ALTERNATING_HINT in t.decision.note for t in ticks if t.holding and t.decision)


def test_alternation_between_two_engines_changes_nothing_and_is_reported() -> None:
    a = [busy(float(t), 109, 1000.0) for t in range(40)]
    b = [busy(float(t), 2, 1700.0) for t in range(40)]
    flips = [a[t] if (t // 3) % 2 == 0 else b[t] for t in range(40)]
    engine, ticks = run(flips)
    assert engine.lowered == []
    assert sum(1 for t in ticks if t.alternation) >= 10


def test_the_same_loop_still_acts_on_real_preemptions_once_the_source_is_stable() -> None:
    """The control: after the alternation has passed, preemptions in one process's own counters lead the
    operator to lower max_num_seqs, as before."""
    a = [busy(float(t), 109, 1000.0) for t in range(10)]
    b = [busy(float(t), 2, 1700.0) for t in range(10, 12)]
    real = [busy(float(t), 109 + 3 * (t - 12), 1000.0) for t in range(12, 40)]
    engine, ticks = run([*a, *b, *real])
    assert any(t.alternation for t in ticks)
    assert engine.lowered, "real preemptions in one process still lead to action"
    first = min(t.at for t in ticks if any(r.ok for _, r in t.applied))
    assert first >= 12 + hold_seconds(POLICY)


# ---- the property ---------------------------------------------------------------------------------------------

Action = tuple[str, int, int]  # (genuine | replay | scaled, process, ticks back or factor in tenths)


@st.composite
def scrape_plans(draw: st.DrawFn) -> tuple[list[float | None], list[float], list[Action]]:
    """Processes with a start time: one to three, and any scaled copies. Without one: a single process,
    and one relay factor (a scaled copy of a scaled copy at another factor is a rise the counters alone
    cannot tell from work, where no start time says which process answered)."""
    anonymous = draw(st.booleans())
    count = 1 if anonymous else draw(st.integers(1, 3))
    starts: list[float | None] = (
        [None]
        if anonymous
        else draw(st.lists(st.floats(100, 5000), min_size=count, max_size=count, unique=True))
    )
    preemptions = draw(st.lists(st.integers(0, 500).map(float), min_size=count, max_size=count))
    kinds = st.sampled_from(["genuine", "replay", "scaled"])
    amounts = st.just(draw(st.integers(1, 9))) if anonymous else st.integers(1, 9)
    actions = draw(st.lists(st.tuples(kinds, st.integers(0, count - 1), amounts), min_size=2, max_size=45))
    return starts, preemptions, actions


def scrapes(starts: list[float | None], preemptions: list[float], actions: list[Action]) -> list[Sample]:
    """Every process's preemption counter is constant (no preemption ever happens in one process); each
    is first seen as itself, then any mix of its own scrapes, stale replays of earlier ones and scaled-down
    copies, interleaved with the other processes'."""
    seen: set[int] = set()
    out: list[Sample] = []
    for t, (kind, process, amount) in enumerate(actions):
        at = float(t)

        def genuine(when: float, p: int = process) -> Sample:
            return busy(when, preemptions[p], starts[p])

        if process not in seen or kind == "genuine":
            sample = genuine(at)
        elif kind == "replay":
            sample = replace(genuine(max(0.0, at - amount)), timestamp=at)
        else:
            sample = scaled(genuine(at), amount / 10, at)
        seen.add(process)
        out.append(sample)
    return out


@settings(
    max_examples=int(os.environ.get("KVTUNE_PROPERTY_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(scrape_plans())
def test_no_alternating_or_replayed_source_makes_the_operator_lower_a_value(
    plan_: tuple[list[float | None], list[float], list[Action]],
) -> None:
    engine, ticks = run(scrapes(*plan_))
    assert engine.lowered == [], [
        (t.at, t.restart, t.alternation, t.decision and t.decision.note) for t in ticks
    ]
