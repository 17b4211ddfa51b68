"""The operator owns its desired values across engine restarts, without HTTP: restart detection (process
start time, counter resets), samples from before a restart dropped, desired values re-applied at once, and
the desired values kept in status so a restarted operator puts them back too."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from kvtune.contract import metrics as m
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.diagnosis import Diagnosis
from kvtune.operator.decide.ladder import Remedy
from kvtune.operator.decide.loop import Tick, step
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.ports import ActuatorResult
from kvtune.operator.decide.restart import drifted, engine_restarted
from kvtune.operator.decide.sample import Sample, SampleResult
from kvtune.operator.decide.tuner import JudgedFigures, Pending, TunerState, _evaluate
from kvtune.operator.k8s.crd import DesiredValues, KVTuningPolicyStatus, state_from_status, state_to_status
from tests.operator.helpers import parse_exposition, synthetic

POLICY = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=2.0, cooldown_s=2.0)


def started_at(sample: Sample, start: float) -> Sample:
    return replace(sample, gauges={**sample.gauges, m.PROCESS_START: start})


def test_a_moved_process_start_time_is_a_restart_even_when_counters_grew() -> None:
    before = started_at(synthetic(0, preemptions=5, generated=100), 1000.0)
    after = started_at(synthetic(5, preemptions=9, generated=900), 1003.5)
    reason = engine_restarted(before, after)
    assert reason is not None and "process_start_time_seconds" in reason and "1003.50" in reason


def test_a_falling_counter_is_a_restart() -> None:
    reason = engine_restarted(synthetic(0, preemptions=26, generated=500), synthetic(5, preemptions=0))
    assert reason is not None and "fell" in reason and m.GENERATION_TOKENS in reason


def test_the_same_process_is_not_a_restart() -> None:
    before = started_at(synthetic(0, preemptions=5, generated=100), 1000.0)
    assert engine_restarted(before, started_at(synthetic(5, preemptions=5, generated=300), 1000.0)) is None
    assert engine_restarted(synthetic(0, generated=1), synthetic(1, generated=1)) is None  # nothing moved


def test_the_engine_exports_its_process_start_time() -> None:
    text = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e9\n"
    sample = parse_exposition(text, 0.0, "test")
    assert isinstance(sample, Sample) and sample.gauges[m.PROCESS_START] == 1.7e9


def test_drifted_lists_only_the_values_the_engine_lost() -> None:
    desired: dict[str, int | str | None] = {KNOB_MAX_NUM_SEQS: 10, KNOB_MAX_TOKENS_CAP: None}
    assert drifted(desired, {KNOB_MAX_NUM_SEQS: 32, KNOB_MAX_TOKENS_CAP: None}) == {KNOB_MAX_NUM_SEQS: 10}
    assert drifted(desired, {KNOB_MAX_NUM_SEQS: 10, KNOB_MAX_TOKENS_CAP: 400}) == {KNOB_MAX_TOKENS_CAP: None}
    assert drifted(desired, {}) == {}


class Engine:
    """An engine's knobs, which a restart puts back to its flags."""

    knobs = frozenset({KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP})

    def __init__(self, flags: dict[str, int | None]) -> None:
        self.flags = dict(flags)
        self.values: dict[str, int | None] = dict(flags)
        self.calls: list[tuple[str, int | str | None]] = []

    def restart(self) -> None:
        self.values = dict(self.flags)

    def current(self) -> ActuatorResult:
        return ActuatorResult(True, dict(self.values))

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        assert value is None or isinstance(value, int)
        self.calls.append((knob, value))
        self.values[knob] = value
        return ActuatorResult(True, dict(self.values))


class Replay:
    def __init__(self) -> None:
        self.next: SampleResult | None = None

    def read(self) -> SampleResult:
        assert self.next is not None
        return self.next


def preempting(t: float, start: float, base: float = 0.0) -> Sample:
    """A kvtune engine under pressure: 2 preemptions a second since `base`."""
    return started_at(
        synthetic(t, preemptions=2 * (t - base), generated=300 * (t - base), kv=0.97, running=12, waiting=4),
        start,
    )


def test_a_restart_drops_old_samples_and_puts_the_desired_value_back_at_once() -> None:
    engine, source = Engine({KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: None}), Replay()
    state, samples = TunerState(), deque[Sample](maxlen=20)
    ticks: list[Tick] = []
    for t in range(0, 6):
        source.next = preempting(float(t), start=1000.0)
        ticks.append(step(source, engine, POLICY, state, samples, float(t)))
        state = ticks[-1].state
    assert engine.calls, "the pressure makes the tuner act"
    desired = dict(state.desired)
    assert desired and all(engine.values[k] == v for k, v in desired.items())
    acted = len(engine.calls)

    engine.restart()  # back at its flags; the new process counts from zero
    assert any(engine.values[k] != v for k, v in desired.items())
    source.next = preempting(10.0, start=1009.0, base=9.5)
    tick = step(source, engine, POLICY, state, samples, 10.0)
    assert tick.restart is not None and "process_start_time_seconds" in tick.restart
    assert [(k, v) for k, v, r in tick.reapplied if r.ok] == sorted(
        (k, v) for k, v in desired.items() if engine.flags[k] != v
    )
    assert all(engine.values[k] == v for k, v in desired.items())  # held again before any new evidence
    assert list(samples) == [source.next] and tick.evidence_since == 10.0
    assert tick.decision is not None and tick.decision.diagnosis.samples == 1
    assert tick.decision.diagnosis.restarts == 0  # the old process' counters are not in the window
    assert not tick.applied, "no tuning action on one post-restart sample"
    state = tick.state
    for t in (10.5, 11.0, 11.5):
        source.next = preempting(t, start=1009.0, base=9.5)
        later = step(source, engine, POLICY, state, samples, t)
        state = later.state
        assert later.restart is None and later.reapplied == ()
        assert later.evidence_since is not None and later.evidence_since >= 10.0
        assert later.decision is not None and later.decision.diagnosis.restarts == 0
    assert len(engine.calls) >= acted + 1


def test_without_apply_mode_nothing_is_put_back() -> None:
    engine, source = Engine({KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: None}), Replay()
    state = TunerState(desired=((KNOB_MAX_NUM_SEQS, 8),))
    source.next = preempting(0.0, start=1.0)
    tick = step(source, engine, replace(POLICY, mode=Mode.RECOMMEND), state, deque(), 0.0)
    assert tick.reapplied == () and engine.values[KNOB_MAX_NUM_SEQS] == 64


def test_desired_values_survive_in_status_and_a_resumed_operator_applies_them() -> None:
    engine, source = Engine({KNOB_MAX_NUM_SEQS: 32, KNOB_MAX_TOKENS_CAP: 300}), Replay()
    state = TunerState(desired=((KNOB_MAX_NUM_SEQS, 10), (KNOB_MAX_TOKENS_CAP, None)))
    tuner, history = state_to_status(state)
    status = KVTuningPolicyStatus(tuner_state=tuner, history=history, desired=DesiredValues.of(state.desired))
    dumped = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert dumped["desired"] == {"maxNumSeqs": 10, "maxTokensCap": 0}  # 0: no cap
    resumed = state_from_status(KVTuningPolicyStatus.model_validate(dumped))
    assert resumed.desired == state.desired
    # the first tick of the resumed operator: no sample held yet, the engine differs, so it is set back
    source.next = preempting(0.0, start=1.0)
    tick = step(source, engine, POLICY, resumed, deque(), 0.0)
    assert {(k, v) for k, v, r in tick.reapplied if r.ok} == {
        (KNOB_MAX_NUM_SEQS, 10),
        (KNOB_MAX_TOKENS_CAP, None),
    }
    assert engine.values == {KNOB_MAX_NUM_SEQS: 10, KNOB_MAX_TOKENS_CAP: None}
    assert tick.restart is None  # nothing to compare with: an operator restart, not an engine one


def test_a_rollback_makes_the_old_value_the_desired_one() -> None:
    figures = JudgedFigures(0.1, 500.0, 0.95, 2.0)
    pending = Pending(0.0, Remedy.LOWER_MAX_NUM_SEQS, KNOB_MAX_NUM_SEQS, 12, 8, "lower", figures)
    state = TunerState(pending=pending).desire(KNOB_MAX_NUM_SEQS, 8)
    worse = Diagnosis("active", preemption_rate=5.0, goodput=100.0, waiting_mean=3.0, samples=4)
    state, rollback = _evaluate(pending, worse, POLICY, state, 10.0)
    assert rollback is not None and rollback.value == 12
    assert dict(state.desired) == {KNOB_MAX_NUM_SEQS: 12}


def with_pool(sample: Sample, tokens: int) -> Sample:
    return replace(sample, cache_config={**sample.cache_config, "kv_cache_size_tokens": str(tokens)})


def test_a_restart_with_a_different_pool_sizes_max_num_seqs_again_and_keeps_the_cap() -> None:
    engine, source = Engine({KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: None}), Replay()
    state = TunerState(
        desired=((KNOB_MAX_NUM_SEQS, 8), (KNOB_MAX_TOKENS_CAP, 300)),
        unsafe_max_num_seqs=9,
        unsafe_since=0.0,
        exhausted=frozenset({Remedy.CAP_MAX_TOKENS, Remedy.LOWER_MAX_NUM_SEQS}),
    )
    samples = deque[Sample]([with_pool(preempting(5.0, start=1000.0), 1024)], maxlen=20)
    engine.values = {KNOB_MAX_NUM_SEQS: 8, KNOB_MAX_TOKENS_CAP: 300}
    engine.restart()  # FP8 KV at the same bytes: twice the pool
    source.next = with_pool(preempting(10.0, start=1009.0, base=9.5), 2048)
    tick = step(source, engine, POLICY, state, samples, 10.0)
    assert tick.restart is not None
    assert [(k, v) for k, v, r in tick.reapplied if r.ok] == [(KNOB_MAX_TOKENS_CAP, 300)]
    assert engine.values == {KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: 300}  # its flag, for the first cut
    assert dict(tick.state.desired) == {KNOB_MAX_TOKENS_CAP: 300}
    assert tick.state.unsafe_max_num_seqs is None
    assert tick.state.exhausted == frozenset({Remedy.CAP_MAX_TOKENS})


def test_a_restart_with_the_same_pool_keeps_the_desired_max_num_seqs() -> None:
    engine, source = Engine({KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: None}), Replay()
    state = TunerState(desired=((KNOB_MAX_NUM_SEQS, 8),), unsafe_max_num_seqs=9, unsafe_since=0.0)
    samples = deque[Sample]([with_pool(preempting(5.0, start=1000.0), 1024)], maxlen=20)
    source.next = with_pool(preempting(10.0, start=1009.0, base=9.5), 1024)
    tick = step(source, engine, POLICY, state, samples, 10.0)
    assert tick.restart is not None and engine.values[KNOB_MAX_NUM_SEQS] == 8
    assert tick.state.unsafe_max_num_seqs == 9
