"""The replica signal over synthetic windows, time explicit: once per evaluation window, held while a
change of the tuner's is pending, a smaller count only when two evaluations agree; and the autoscalers that
drive a workload, where two withdraw it."""

from __future__ import annotations

from dataclasses import replace

from kvtune.contract import metrics as m
from kvtune.operator.decide.policy import Mode, ScalingPolicy, TuningPolicy
from kvtune.operator.decide.scaling import ScalingSignal, ScalingState, evaluate, replicas_in
from kvtune.operator.decide.window import Window
from kvtune.operator.k8s.autoscalers import autoscalers_of, conflict_message
from tests.operator.predicted_world import engine, sample

BOUNDED = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=4, cooldown_s=4, predict=True, p95_wait_bound_s=0.5,
                       scaling=ScalingPolicy(1, 8))  # fmt: skip


def window(t0: int, t1: int, *, pods: int = 1, waiting: float = 8) -> Window:
    samples = [sample(t, preemptions=0.0, waiting=waiting) for t in range(t0, t1 + 1)]
    return Window.of([replace(s, gauges={**s.gauges, m.POOLED_PODS: float(pods)}) for s in samples])


def test_no_scaling_spec_no_signal() -> None:
    plain = replace(BOUNDED, scaling=None)
    assert evaluate(window(0, 6), engine(16), plain, False, ScalingState(), 6) == ScalingState()


def test_the_pods_of_the_window_are_the_replicas_now() -> None:
    assert replicas_in(window(0, 3, pods=3)) == 3
    assert replicas_in(Window.of([sample(0, preemptions=0.0)])) == 1  # one engine read directly


def test_a_queue_the_bound_cannot_hold_asks_for_more_replicas_once_per_window() -> None:
    first = evaluate(window(0, 6), engine(16), BOUNDED, False, ScalingState(), 6)
    signal = first.signal
    assert signal is not None and signal.desired is not None and signal.desired > 1, signal
    assert signal.ratio is not None and signal.desired >= signal.ratio > 1
    assert (
        signal.max_num_seqs is not None
        and "clients" in signal.demand
        and "closed loop" in signal.demand_evidence
    )
    # within the evaluation window the signal is not recomputed
    assert evaluate(window(0, 8), engine(16), BOUNDED, False, first, 8) is first


def test_a_pending_admission_change_holds_the_signal() -> None:
    before = ScalingState(ScalingSignal(0, 1, 3, 2.5, 12, "24 clients", "three"))
    held = evaluate(window(0, 6), engine(16), BOUNDED, True, before, 6)
    assert held.signal is not None and held.signal.desired == 3
    assert held.signal.held is not None and "admission first" in held.signal.held


def test_a_smaller_count_needs_a_second_evaluation_that_agrees() -> None:
    high = ScalingState(ScalingSignal(0, 6, 6, 5.5, 12, "", "six"))
    quiet = window(10, 16, waiting=0)  # the queue is gone: fewer replicas do
    once = evaluate(quiet, engine(16), BOUNDED, False, high, 16)
    assert once.signal is not None and once.signal.desired == 6 and once.lower_seen is not None
    assert once.signal.held is not None and "second evaluation" in once.signal.held
    twice = evaluate(window(20, 26, waiting=0), engine(16), BOUNDED, False, once, 26)
    assert twice.signal is not None and twice.signal.desired is not None and twice.signal.desired < 6
    assert twice.lower_seen is None


def test_a_window_with_nothing_to_fit_keeps_the_last_count() -> None:
    last = ScalingState(ScalingSignal(0, 2, 2, 1.5, 12, "", "two"))
    short = Window.of([sample(10, preemptions=0.0)])
    kept = evaluate(short, engine(16), BOUNDED, False, last, 10)
    assert kept.signal is not None and kept.signal.desired == 2 and "no fit" in kept.signal.reason


def hpa(name: str, target: str, owner: str | None = None) -> dict[str, object]:
    owners = [{"kind": "ScaledObject", "name": owner}] if owner else []
    return {"metadata": {"name": name, "ownerReferences": owners},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target}}}  # fmt: skip


def scaled_object(name: str, target: str) -> dict[str, object]:
    return {"metadata": {"name": name}, "spec": {"scaleTargetRef": {"name": target}}}


def test_keda_s_own_hpa_is_its_scaled_object_not_a_second_autoscaler() -> None:
    found = autoscalers_of("Deployment", "llama", [hpa("keda-hpa-kvtune", "llama", owner="kvtune")],
                           [scaled_object("kvtune", "llama"), scaled_object("other", "mistral")])  # fmt: skip
    assert found == ["ScaledObject/kvtune"]
    assert conflict_message(found) is None


def test_two_autoscalers_on_one_workload_withdraw_the_signal() -> None:
    found = autoscalers_of("Deployment", "llama", [hpa("queue", "llama")],
                           [scaled_object("kvtune", "llama")])  # fmt: skip
    assert found == ["HorizontalPodAutoscaler/queue", "ScaledObject/kvtune"]
    message = conflict_message(found)
    assert message is not None and "withdrawn" in message
    assert autoscalers_of("StatefulSet", "llama", [hpa("queue", "llama")], []) == []


def test_the_doctor_says_the_replicas_needed_at_this_load() -> None:
    from kvtune.core.predict import Objective
    from kvtune.operator.doctor.whatif import what_if_section, what_if_text

    samples = [sample(t, preemptions=0.0) for t in range(0, 7)]
    section = what_if_section(samples, engine(16), Objective(p95_wait_bound_s=0.5))
    replicas = section["replicas"]
    assert replicas["replicas_now"] == 1 and replicas["replicas_needed"] > 1
    assert replicas["demand"].endswith("clients")
    line = next(text for text in what_if_text(section) if "replicas needed at this load" in text)
    assert f"{replicas['replicas_needed']} replicas at" in line
