"""The ladder and the tuner on synthetic windows: order, one rung at a time, bounds, cooldown, max step,
hysteresis and rollback. Time is explicit, so every case is exact."""

from __future__ import annotations

from dataclasses import replace

from kvtune.contract import metrics as m
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.operator.decide.diagnosis import diagnose
from kvtune.operator.decide.ladder import (
    LADDER,
    Remedy,
    plan,
    pool_binds,
    raise_max_num_seqs,
    recommend_fp8_kv,
)
from kvtune.operator.decide.policy import Mode
from kvtune.operator.decide.sample import Sample
from kvtune.operator.decide.tuner import JudgedFigures, Pending, TunerState, decide
from kvtune.operator.decide.window import Window
from tests.operator.helpers import kvtune_engine, synthetic
from tests.operator.ladder_steps import POLICY, preempting, step


def calm(
    t0: float, t1: float, running: float, kv: float, waiting: float = 5, base: float = 50
) -> list[Sample]:
    return [synthetic(t0, preemptions=base, generated=9000, kv=kv, running=running, waiting=waiting),
            synthetic(t1, preemptions=base, generated=9000 + 800 * (t1 - t0), kv=kv, running=running,
                      waiting=waiting)]  # fmt: skip


def test_cap_comes_first_when_clients_declare_more_than_they_use() -> None:
    samples = preempting(0, 10, declared_max=1000)
    decision, state = step(samples, kvtune_engine(), TunerState(), 10)
    assert [(c.knob, c.value) for c in decision.changes] == [("max_tokens_cap", 250)]  # p99 199 x 1.25
    assert state.rung is Remedy.CAP_MAX_TOKENS and state.pending is not None
    # still preempting after the evaluation window: the cap is exhausted, the next rung starts
    later = [*samples, synthetic(15, preemptions=60, generated=6000, kv=1.0, running=8, waiting=5,
                                 declared_max=1000),
             synthetic(21, preemptions=80, generated=7000, kv=1.0, running=8, waiting=5, declared_max=1000)]  # fmt: skip
    decision, state = step(later, kvtune_engine(cap=250), state, 21)
    assert Remedy.CAP_MAX_TOKENS in state.exhausted
    assert [(c.knob, c.value) for c in decision.changes] == [("max_num_seqs", 3)]


def test_a_cap_is_kept_when_preemptions_rise_with_the_goodput_held() -> None:
    # a cap only shortens generations: it cannot make more preemptions. The demo's cap was undone within
    # 5 s on 1.97 -> 2.21/s (the load warming up); now the rate rising from 5 to 6/s keeps it, and the
    # next rung starts since it still preempts
    samples = preempting(0, 10, declared_max=1000)
    _, state = step(samples, kvtune_engine(), TunerState(), 10)
    assert state.pending is not None and state.pending.direction == "cap"
    more = [synthetic(t, preemptions=50 + 6 * (t - 10), generated=5000 + 500 * (t - 10), kv=1.0, running=8,
                      waiting=5, declared_max=1000) for t in (10, 21)]  # fmt: skip
    decision, state = step(more, kvtune_engine(cap=250), state, 21)
    assert all(h.kind != "rolled_back" for h in state.history)
    assert Remedy.CAP_MAX_TOKENS in state.exhausted
    assert [(c.knob, c.value) for c in decision.changes] == [("max_num_seqs", 3)]


def test_a_cap_is_rolled_back_when_the_goodput_falls_without_fewer_preemptions() -> None:
    _, state = step(preempting(0, 10, declared_max=1000), kvtune_engine(), TunerState(), 10)
    worse = [synthetic(t, preemptions=50 + 6 * (t - 10), generated=5000 + 50 * (t - 10), kv=1.0, running=8,
                       waiting=5, declared_max=1000) for t in (10, 21)]  # fmt: skip
    decision, state = step(worse, kvtune_engine(cap=250), state, 21)
    assert [(c.knob, c.before, c.value) for c in decision.changes] == [("max_tokens_cap", 250, None)]
    assert "goodput fell 500 -> 50 tokens/s without fewer preemptions" in decision.changes[0].reason


def test_a_full_pool_without_preemption_waits_an_evaluation_window_before_the_first_rung() -> None:
    # one second of a full pool between preemption bursts is no evidence for the prefix flag or FP8
    short, _ = step(calm(0, 1, running=4, kv=1.0), kvtune_engine(64), TunerState(), 1)
    assert short.changes == () and short.advice == () and "gathering" in short.note
    full, _ = step(calm(0, 10, running=4, kv=1.0), kvtune_engine(64), TunerState(), 10)
    assert Remedy.RECOMMEND_FP8_KV in [a.remedy for a in full.advice]


def test_cap_never_below_the_floor() -> None:
    policy = replace(POLICY, cap_floor=400)
    decision, _ = step(preempting(0, 10, declared_max=1000), kvtune_engine(), TunerState(), 10, policy)
    assert decision.changes[0].value == 400


def test_lower_is_sized_from_the_real_ceiling_when_the_cap_would_not_bind() -> None:
    decision, state = step(preempting(0, 10), kvtune_engine(), TunerState(), 10)
    assert [(c.knob, c.before, c.value) for c in decision.changes] == [("max_num_seqs", 64, 3)]
    assert state.unsafe_max_num_seqs == 64
    assert state.history[-1].kind == "applied" and "ceiling" in state.history[-1].evidence


def test_first_step_sizes_the_p95_of_the_residents_total_footprint() -> None:
    def with_sums(sample: Sample) -> Sample:
        hists = dict(sample.histograms)
        for name, mean in ((m.REQUEST_PROMPT_TOKENS, 75.0), (m.REQUEST_GENERATION_TOKENS, 150.0)):
            hists[name] = replace(hists[name], total=mean * hists[name].count)
        return replace(sample, histograms=hists)

    samples = [with_sums(s) for s in preempting(0, 10, running=20)]
    engine = replace(kvtune_engine(), pool_tokens=4096)
    d = diagnose(Window.of(samples), engine)
    # 4,096 / p95 292 = 14 (all at p95 at once); 4,096 / mean 225 = 18; 16 x 225 + 4 x 67 = 3,868 fits, 17 not
    assert (d.real_concurrency_ceiling, d.pooled_p95_concurrency, d.mean_footprint_concurrency) == (
        14,
        16,
        18,
    )
    decision, _ = step(samples, engine, TunerState(), 10)
    assert [(c.knob, c.before, c.value) for c in decision.changes] == [("max_num_seqs", 64, 16)]
    lower = plan(d, engine, POLICY)[1]
    assert (lower.applicable, lower.recommended) == (True, 16)
    assert lower.evidence.startswith("sized from the p95 of the residents' total footprint")
    assert "p95 footprint 292 = 14; p95 of 16 residents' total footprint ~ 16 x 225 (mean)" in lower.evidence


def test_bounds_and_max_step() -> None:
    policy = replace(POLICY, min_max_num_seqs=5, max_step=10)
    decision, _ = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10, policy)
    assert decision.changes[0].value == 54  # sized 3, but at most 10 down
    decision, _ = step(preempting(0, 10, running=6), kvtune_engine(6), TunerState(), 10, policy)
    assert decision.changes[0].value == 5  # never below the floor
    decision, _ = step(preempting(0, 10, running=5), kvtune_engine(5), TunerState(), 10, policy)
    assert all(c.knob != "max_num_seqs" for c in decision.changes)  # exhausted at the floor


def test_feedback_lowers_until_preemption_stops_then_flags_and_fp8_once_exhausted() -> None:
    policy = replace(POLICY, min_max_num_seqs=2, shared_prefix_tokens=12)
    _, state = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10, policy)
    # a lowering is judged one window after the limit held (the old value's survivors have left by then)
    samples = [synthetic(t, preemptions=50 + 2 * (t - 10), generated=5000 + 100 * (t - 10), kv=1, running=3,
                         waiting=5) for t in (10, 21, 31)]  # fmt: skip
    decision, state = step(samples, kvtune_engine(3), state, 31, policy)
    assert [(c.before, c.value) for c in decision.changes] == [(3, 2)]
    assert "feedback" in decision.changes[0].reason
    samples = [synthetic(t, preemptions=90 + 2 * (t - 31), generated=7000 + 100 * (t - 31), kv=1, running=2,
                         waiting=5) for t in (31, 42, 52)]  # fmt: skip
    decision, state = step(samples, kvtune_engine(2), state, 52, policy)
    # at the floor: lowering is exhausted, so rungs 3 and 4 begin, as a flag and a recommendation
    assert decision.changes == ()
    assert [a.remedy for a in decision.advice] == [Remedy.FLAG_PREFIX_DEFEAT, Remedy.RECOMMEND_FP8_KV]
    assert "shorter than one block" in decision.advice[0].evidence
    assert "2x the tokens" in decision.advice[1].evidence and "accuracy" in decision.advice[1].evidence
    again, _ = step(samples, kvtune_engine(2), state, 53, policy)
    assert again.advice == ()  # recorded once


def test_fp8_is_applied_only_when_the_policy_allows_and_an_actuator_can() -> None:
    policy = replace(POLICY, min_max_num_seqs=8, allow_fp8=True)
    engine = replace(kvtune_engine(8), knobs=kvtune_engine().knobs | {"kv_cache_dtype"})
    decision, _ = step(preempting(0, 10), engine, TunerState(), 10, policy)
    assert [(c.knob, c.value) for c in decision.changes] == [("kv_cache_dtype", "fp8")]
    decision, _ = step(preempting(0, 10), kvtune_engine(8), TunerState(), 10, policy)
    assert decision.changes == () and decision.advice[-1].remedy is Remedy.RECOMMEND_FP8_KV


def test_cooldown_and_evaluation_window_hold_the_next_action() -> None:
    _, state = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10)
    samples = [*preempting(0, 10), synthetic(12, preemptions=60, generated=6000, kv=1, running=3, waiting=5),
               synthetic(15, preemptions=70, generated=6500, kv=1, running=3, waiting=5)]  # fmt: skip
    decision, held = step(samples, kvtune_engine(3), state, 15)
    assert decision.changes == () and "evaluating" in decision.note
    # nothing moves but the record of when the new limit first held (at 12: running 3 <= 3)
    assert held.pending is not None and held.pending.held_at == 12
    assert replace(held, pending=replace(held.pending, held_at=None)) == state


def test_no_change_is_judged_before_running_requests_drain_under_the_new_limit() -> None:
    _, state = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10)
    draining = [synthetic(t, preemptions=50 + t, generated=5000 + 100 * t, kv=1, running=8, waiting=5)
                for t in (11, 15, 21)]  # fmt: skip
    decision, held = step(draining, kvtune_engine(3), state, 21)
    assert decision.changes == () and "settle" in decision.note and held.pending is not None


def test_a_lowering_is_judged_after_the_old_values_survivors_leave() -> None:
    _, state = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10)
    # drained under 3 at once; one preemption at 15 among the survivors, none after
    samples = [synthetic(t, preemptions=50 if t < 15 else 52, generated=5000 + 100 * (t - 10), kv=0.9, running=3,
                         waiting=5) for t in (10, 15, 20, 25, 30)]  # fmt: skip
    decision, held = step(samples, kvtune_engine(3), state, 25)
    assert decision.changes == () and "evaluating" in decision.note and held.pending is not None
    decision, state = step(samples, kvtune_engine(3), state, 30)
    assert decision.changes == () and state.pending is None  # kept, and no feedback step below 3
    assert not decision.diagnosis.preempting


def test_raise_with_hysteresis_and_rollback_when_it_preempts() -> None:
    state = TunerState(unsafe_max_num_seqs=None)
    decision, state = step(calm(0, 10, running=4, kv=0.2), kvtune_engine(4), state, 10)
    # the projection allows 4 x 0.8 / 0.2 = 16, but the headroom (0.8 - 0.2) x 1,024 tokens holds only two
    # whole requests at the p95 footprint (~293 tokens)
    assert [(c.before, c.value) for c in decision.changes] == [(4, 6)]
    samples = [synthetic(10, preemptions=50, generated=9000, kv=0.9, running=6, waiting=5),
               synthetic(21, preemptions=58, generated=18000, kv=1.0, running=6, waiting=5)]  # fmt: skip
    decision, state = step(samples, kvtune_engine(6), state, 21)
    # a raise of two seats that preempted steps back one seat, judged like a lowering
    assert [(c.before, c.value) for c in decision.changes] == [(6, 5)]
    assert decision.changes[0].reason.startswith("step back")
    assert state.unsafe_max_num_seqs == 6 and state.history[-1].kind == "rolled_back"
    assert state.history[-2].after_figures is not None  # the raise got its after figures
    assert state.pending is not None and state.pending.direction == "lower"
    # headroom again later: the step back is kept, and nothing goes back up to the value that preempted
    decision, state = step(calm(40, 50, running=5, kv=0.2, base=58), kvtune_engine(5), state, 50)
    assert decision.changes == () and state.pending is None


def test_a_one_seat_raise_that_preempts_goes_back_where_it_came_from() -> None:
    _, state = step(calm(0, 10, running=4, kv=0.5), kvtune_engine(4), TunerState(), 10)
    pending = Pending(
        10, Remedy.LOWER_MAX_NUM_SEQS, KNOB_MAX_NUM_SEQS, 4, 5, "raise", JudgedFigures(0.0, 900.0, 0.5, 5.0)
    )
    state = replace(state, pending=pending, last_action_at=10, rung=Remedy.LOWER_MAX_NUM_SEQS)
    samples = [synthetic(10, preemptions=50, generated=9000, kv=0.9, running=5, waiting=5),
               synthetic(21, preemptions=58, generated=18000, kv=1.0, running=5, waiting=5)]  # fmt: skip
    decision, state = step(samples, kvtune_engine(5), state, 21)
    assert [(c.before, c.value) for c in decision.changes] == [(5, 4)]
    assert decision.changes[0].reason.startswith("rollback") and state.unsafe_max_num_seqs == 5


def test_no_raise_without_waiting_requests_or_headroom() -> None:
    decision, _ = step(calm(0, 10, running=4, kv=0.5, waiting=0), kvtune_engine(4), TunerState(), 10)
    assert decision.changes == ()
    decision, _ = step(calm(0, 10, running=4, kv=0.8), kvtune_engine(4), TunerState(), 10)
    assert decision.changes == ()


def test_no_raise_when_the_headroom_holds_no_whole_request() -> None:
    # scaling usage up says 4 x 0.8 / 0.6 = 5 fit, but (0.8 - 0.6) x 1,024 = 205 tokens cannot hold one
    # request at the p95 footprint (~293): such a probe preempts at the peaks and is rolled back
    engine = kvtune_engine(4)
    advice = raise_max_num_seqs(
        diagnose(Window.of(calm(0, 10, running=4, kv=0.6)), engine), engine, POLICY, None
    )
    assert not advice.applicable and "headroom holds 0 p95-footprint requests" in advice.evidence
    decision, _ = step(calm(0, 10, running=4, kv=0.6), engine, TunerState(), 10)
    assert decision.changes == ()


def test_lower_rolled_back_when_preemptions_rise() -> None:
    _, state = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10)
    worse = [synthetic(10, preemptions=50, generated=5000, kv=1, running=3, waiting=5),
             synthetic(21, preemptions=200, generated=5500, kv=1, running=3, waiting=5),
             synthetic(31, preemptions=350, generated=6000, kv=1, running=3, waiting=5)]  # fmt: skip
    decision, state = step(worse, kvtune_engine(3), state, 31)
    assert [(c.before, c.value) for c in decision.changes] == [(3, 64)]
    assert "goodput fell 500 -> 50 tokens/s without fewer preemptions" in decision.changes[0].reason
    assert Remedy.LOWER_MAX_NUM_SEQS in state.exhausted


def test_a_lowering_that_preempts_more_but_keeps_its_goodput_is_kept_and_stepped_down() -> None:
    # the before-window caught the load warming up (5/s); at 3 the rate is 10/s with the goodput held:
    # fewer residents cannot be the cause, so the feedback steps further down instead of undoing the cut
    _, state = step(preempting(0, 10), kvtune_engine(64), TunerState(), 10)
    assert state.pending is not None and state.pending.after == 3
    more = [synthetic(t, preemptions=50 + 10 * (t - 10), generated=5000 + 500 * (t - 10), kv=1, running=3,
                      waiting=5) for t in (10, 21, 31)]  # fmt: skip
    decision, state = step(more, kvtune_engine(3), state, 31)
    assert [(c.before, c.value) for c in decision.changes] == [(3, 2)]
    assert "feedback" in decision.changes[0].reason
    assert Remedy.LOWER_MAX_NUM_SEQS not in state.exhausted


def test_modes_observe_and_recommend_change_nothing() -> None:
    for mode in (Mode.OBSERVE, Mode.RECOMMEND):
        decision, state = step(
            preempting(0, 10), kvtune_engine(), TunerState(), 10, replace(POLICY, mode=mode)
        )
        assert decision.changes == ()
    assert any(h.kind == "recommended" and h.after == 3 for h in state.history)


def test_no_data_and_single_samples_never_act() -> None:
    decision, state = step([], kvtune_engine(), TunerState(), 10)
    assert decision.diagnosis.status == "no_data" and decision.changes == () and state == TunerState()
    decision, _ = step(preempting(0, 10)[1:], kvtune_engine(), TunerState(), 10)
    assert decision.changes == ()


def test_zero_traffic_window_does_nothing() -> None:
    quiet = [synthetic(t, preemptions=9, generated=100, kv=0, running=0) for t in (0, 10)]
    decision, _ = step(quiet, kvtune_engine(), TunerState(), 10)
    assert decision.changes == () and decision.note == "idle"


def test_history_is_bounded() -> None:
    state = TunerState()
    for i in range(50):
        _, state = step(preempting(100 * i, 100 * i + 10), kvtune_engine(64), replace(state, pending=None,
                        last_action_at=None, unsafe_max_num_seqs=None), 100 * i + 10)  # fmt: skip
    assert len(state.history) == 32


def test_plan_lists_every_rung_in_ladder_order() -> None:
    samples = preempting(0, 10)
    d = decide(Window.of(samples), kvtune_engine(), POLICY, TunerState(), 10)[0].diagnosis
    remedies = plan(d, kvtune_engine(), POLICY)
    assert [r.remedy for r in remedies] == list(LADDER)
    assert [r.applicable for r in remedies] == [False, True, False, True]


def test_when_the_pool_binds_after_rung_two_the_flag_and_fp8_come_without_preemption() -> None:
    """Rung 2 holds max_num_seqs at what the pool fits: nothing preempts and KV usage is well under full, yet
    requests wait on the pool; the seed's rungs 3 and 4 are for exactly this, and only advise."""
    engine = kvtune_engine(4)
    d = diagnose(Window.of(calm(0, 10, running=4, kv=0.6, waiting=6)), engine)
    assert not d.preempting and not d.saturated
    bound = replace(d, mean_footprint_concurrency=4)
    assert pool_binds(bound, engine) and not pool_binds(replace(d, mean_footprint_concurrency=9), engine)
    assert not pool_binds(replace(bound, waiting_mean=0.0), engine)
    advice = recommend_fp8_kv(bound, engine, POLICY)
    assert advice.applicable and advice.evidence.startswith("the pool binds: 6.0 requests wait")
    assert not recommend_fp8_kv(replace(d, mean_footprint_concurrency=9), engine, POLICY).applicable
