"""How fast and where the tuner settles: the first cut is judged one window after its limit held (even once
the caller's short window has slid past that moment), then one probe up to pool / mean footprint; and, on
a model engine whose safe concurrency hypothesis draws, it never leaves its bounds, never raises while
preempting (except to roll back a lowering that made things worse) and settles."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.contract import metrics as m
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.diagnosis import Diagnosis
from kvtune.operator.decide.ladder import probe_max_num_seqs
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.sample import EngineView, Histogram, Sample
from kvtune.operator.decide.tuner import Decision, TunerState, decide
from kvtune.operator.decide.window import Window

POOL = 6144
WINDOW_S = 3.0
POLICY = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=WINDOW_S, cooldown_s=WINDOW_S)
KEPT = 5  # samples the caller keeps, as kvtune operator --local keeps for a 3 s window at 1 s intervals


def lengths(low: float, high: float, finished: float) -> Histogram:
    """`finished` requests spread evenly over (low, high], in ten buckets, with their exact sum."""
    step = (high - low) / 10
    buckets = [(low, 0.0)] + [(low + step * (i + 1), finished * (i + 1) / 10) for i in range(10)]
    return Histogram((*buckets, (float("inf"), finished)), finished, finished * (low + high) / 2)


@dataclass
class ModelEngine:
    """A closed-loop engine reduced to what the tuner reads: `clients` requests always in flight, at most
    max_num_seqs of them running; more than `safe` running preempt, at a rate growing with the excess, and
    lose goodput to recomputation. Prompts 150-450 and outputs 80-240 tokens (footprint mean 460)."""

    max_num_seqs: int
    safe: int
    clients: int
    t: float = 0.0
    preemptions: float = 0.0
    generated: float = 0.0
    finished: float = 50.0
    survivor_preemption_at: float | None = None  # one preemption then, whatever runs
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=KEPT))

    def tick(self) -> None:
        running = min(self.max_num_seqs, self.clients)
        excess = max(0, running - self.safe)
        self.t += 1.0
        self.preemptions += 2.0 * excess + (1.0 if self.t == self.survivor_preemption_at else 0.0)
        self.generated += 60.0 * min(running, self.safe) + 20.0 * excess
        self.finished += running / 4
        self.samples.append(
            Sample(
                timestamp=self.t,
                gauges={
                    m.RUNNING: float(running),
                    m.WAITING: float(self.clients - running),
                    m.KV_USAGE: min(1.0, 0.9 * running / self.safe),
                },
                counters={m.PREEMPTIONS: self.preemptions, m.GENERATION_TOKENS: self.generated},
                histograms={
                    m.REQUEST_PROMPT_TOKENS: lengths(150, 450, self.finished),
                    m.REQUEST_GENERATION_TOKENS: lengths(80, 240, self.finished),
                    m.REQUEST_MAX_TOKENS: lengths(80, 240, self.finished),  # a max_tokens cap cannot bind
                },
                cache_config={"block_size": "16", "kv_cache_size_tokens": str(POOL)},
            )
        )

    def view(self) -> EngineView:
        return EngineView(max_num_seqs=self.max_num_seqs, pool_tokens=POOL, block_size=16,
                          knobs=frozenset({KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP}))  # fmt: skip


def run(engine: ModelEngine, seconds: int, policy: TuningPolicy = POLICY) -> list[tuple[float, Decision]]:
    """The local loop against the model engine: a sample a second, decide, apply."""
    state, decisions = TunerState(), []
    for _ in range(seconds):
        engine.tick()
        decision, state = decide(Window.of(engine.samples), engine.view(), policy, state, engine.t)
        for change in decision.changes:
            if change.knob == KNOB_MAX_NUM_SEQS:
                assert isinstance(change.value, int)
                engine.max_num_seqs = change.value
        decisions.append((engine.t, decision))
    return decisions


def trail(decisions: list[tuple[float, Decision]]) -> list[tuple[float, object, object]]:
    return [(t, c.before, c.value) for t, d in decisions for c in d.changes if c.knob == KNOB_MAX_NUM_SEQS]


def test_first_cut_then_one_probe_to_pool_over_mean_footprint_within_five_windows() -> None:
    # the workload: pool 6,144, footprint mean 460 (pool / mean = 13), 24 clients, start 48
    engine = ModelEngine(max_num_seqs=48, safe=13, clients=24)
    changes = trail(run(engine, 60))
    assert [(before, after) for _, before, after in changes] == [(48, 11), (11, 13)]
    assert changes[0][0] == 2.0  # the first tick with two samples
    # the cut held at once (running 11 at t=3), its first window was clean, so the probe goes at once
    assert changes[-1][0] == 6.0 and changes[-1][0] // WINDOW_S + 1 <= 5
    assert "probe" in str(run(ModelEngine(48, 13, 24), 6)[-1][1].changes[0].reason)


def test_a_probe_that_preempts_steps_back_one_seat_and_is_not_tried_again() -> None:
    engine = ModelEngine(max_num_seqs=48, safe=12, clients=24)
    changes = trail(run(engine, 90))
    # 13 preempts: one seat below it (12, the safe value), not back to the first cut (11)
    assert [(before, after) for _, before, after in changes] == [(48, 11), (11, 13), (13, 12)]
    assert changes[-1][0] <= 5 * WINDOW_S and engine.max_num_seqs == 12


def test_a_step_back_that_still_preempts_goes_further_down() -> None:
    engine = ModelEngine(max_num_seqs=48, safe=11, clients=24)
    changes = trail(run(engine, 120))
    # 13 preempts, so does 12: the feedback steps below it, and 13 is never tried again
    assert [(before, after) for _, before, after in changes][:3] == [(48, 11), (11, 13), (13, 12)]
    assert engine.max_num_seqs <= 11 and all(after < 13 for _, _, after in changes[2:])


def test_no_probe_when_nobody_waits() -> None:
    engine = ModelEngine(max_num_seqs=48, safe=13, clients=11)
    assert trail(run(engine, 60)) == []  # 11 clients never preempt at safe 13: nothing to do


def test_a_survivors_preemption_puts_the_judgment_one_window_later_and_is_not_blamed_on_the_cut() -> None:
    engine = ModelEngine(max_num_seqs=48, safe=13, clients=24, survivor_preemption_at=4.0)
    decisions = run(engine, 12)
    # cut at 2, held at 3, one preemption among the old value's survivors at 4: the cut is judged on the
    # window from 6 (3 + one window), at 9, although by 8 the caller's five samples no longer show that
    # preemption; it is kept, no feedback step, and the probe follows at once
    assert trail(decisions) == [(2.0, 48, 11), (9.0, 11, 13)]


@settings(max_examples=25, deadline=None)
@given(
    safe=st.integers(min_value=1, max_value=30),
    clients=st.integers(min_value=1, max_value=64),
    start=st.integers(min_value=1, max_value=96),
    floor=st.integers(min_value=1, max_value=8),
    ceiling=st.integers(min_value=8, max_value=128),
    max_step=st.integers(min_value=1, max_value=64),
)
def test_bounded_never_raises_while_preempting_and_settles(
    safe: int, clients: int, start: int, floor: int, ceiling: int, max_step: int
) -> None:
    bounds = {"min_max_num_seqs": min(floor, start), "max_max_num_seqs": max(ceiling, start)}
    policy = replace(POLICY, max_step=max_step, **bounds)
    engine = ModelEngine(max_num_seqs=start, safe=safe, clients=clients)
    # each step takes at most two windows and a tick (drain, judge); steps down go by max_step from the
    # first cut, then by 20% of the residents (one at least); then a probe and its rollback
    steps, value = -(-start // max_step), start
    while value > 1:
        value, steps = value - max(1, value // 5), steps + 1
    settle_by = (2 * WINDOW_S + 1) * (steps + 3)
    decisions = run(engine, int(settle_by) + 30, policy)
    changes = [(t, d, c) for t, d in decisions for c in d.changes if c.knob == KNOB_MAX_NUM_SEQS]
    for _, d, c in changes:
        assert isinstance(c.value, int) and isinstance(c.before, int)
        assert policy.min_max_num_seqs <= c.value <= policy.max_max_num_seqs
        if d.diagnosis.preempting and c.value > c.before:
            assert c.reason.startswith("rollback"), (c, changes)
    assert all(t <= settle_by for t, _, _ in changes), [(t, c.before, c.value) for t, _, c in changes]


@given(
    current=st.integers(min_value=1, max_value=200),
    pool=st.integers(min_value=64, max_value=200_000),
    mean=st.floats(min_value=1.0, max_value=20_000.0),
    rate=st.floats(min_value=0.0, max_value=50.0),
    waiting=st.floats(min_value=0.0, max_value=50.0),
    unsafe=st.one_of(st.none(), st.integers(min_value=1, max_value=256)),
    max_step=st.integers(min_value=1, max_value=64),
    ceiling=st.integers(min_value=1, max_value=256),
)
def test_a_probe_stays_in_its_bounds_and_never_goes_up_while_preempting(
    current: int, pool: int, mean: float, rate: float, waiting: float, unsafe: int | None, max_step: int,
    ceiling: int,
) -> None:  # fmt: skip
    policy = replace(POLICY, max_max_num_seqs=ceiling, max_step=max_step)
    d = Diagnosis("active", samples=3, preemption_rate=rate, running_max=float(current), waiting_max=waiting,
                  footprint_mean=mean, mean_footprint_concurrency=max(1, int(pool // mean)))  # fmt: skip
    engine = EngineView(max_num_seqs=current, pool_tokens=pool)
    advice = probe_max_num_seqs(d, engine, policy, unsafe)
    if not advice.applicable:
        return
    assert isinstance(advice.recommended, int)
    assert rate == 0 and waiting > 0
    assert current < advice.recommended <= min(ceiling, current + max_step, pool // mean)
    assert unsafe is None or advice.recommended < unsafe
