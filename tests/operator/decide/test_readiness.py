"""The Ready condition (issue 37): False exactly when something stands in the way of what the policy's mode
asks, with the first such thing as its reason; True otherwise, naming what the operator does and what it
waits for by design."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.operator.decide.policy import Mode, effective_mode
from kvtune.operator.decide.status import Standing, ready
from kvtune.operator.io.actuators import KvtuneAdminActuator
from kvtune.operator.k8s.crd import KVTuningPolicySpec, WorkloadWatch
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.reconcile import PolicyMemory, PolicyTick, Prelude, mode_condition, waiting

why = st.none() | st.sampled_from(["a reason", "another reason"])
standings = st.builds(
    Standing,
    st.sampled_from(list(Mode)),
    no_data=why,
    alternating=why,
    actuator=why,
    stalled=why,
    yielded=why,
    rollout=why,
    held=why,
    capped=why,
)
ORDER = ("no_data", "alternating", "actuator", "stalled", "yielded")
REASONS = dict(zip(ORDER, ("NoMetrics", "SourceAlternating", "ActuatorUnavailable", "RolloutStalled",
                           "YieldedToFieldManager"), strict=True))  # fmt: skip
APPLY_ONLY = {"actuator", "stalled", "yielded"}


@given(standings)
def test_ready_is_false_with_the_first_thing_in_the_way_of_the_mode(standing: Standing) -> None:
    status, reason, message = ready(standing)
    blocking = [
        name
        for name in ORDER
        if getattr(standing, name) and (name not in APPLY_ONLY or standing.mode is Mode.APPLY)
    ]
    if blocking:
        assert (status, reason, message) == ("False", REASONS[blocking[0]], getattr(standing, blocking[0]))
    else:
        assert status == "True" and message.startswith(f"runs as {standing.mode.value}")
        expected = "WaitingForRollout" if standing.rollout else {Mode.OBSERVE: "Observing",
                   Mode.RECOMMEND: "Recommending", Mode.APPLY: "Acting"}[standing.mode]  # fmt: skip
        assert reason == expected


def test_what_holds_a_ready_policy_by_design_is_in_its_message() -> None:
    status, reason, message = ready(
        Standing(Mode.APPLY, held="lower max_num_seqs 64 -> 24 held: 2 of 2 restarts used", capped=None)
    )
    assert (status, reason) == ("True", "Acting") and "2 of 2 restarts used" in message
    status, reason, message = ready(Standing(Mode.RECOMMEND, actuator="admin API token secret missing"))
    assert (status, reason) == ("True", "Recommending") and "cannot act: admin API token" in message
    assert ready(Standing(Mode.APPLY, actuator="admin API token secret missing"))[:2] == (
        "False",
        "ActuatorUnavailable",
    )


SPEC = {"target": {"name": "llama", "container": "vllm", "engine": "vllm"},
        "metrics": {"metricsUrl": "http://llama:8000/metrics"}, "mode": "Apply"}  # fmt: skip
ROLLING = "generation 3: 1 of 3 replicas updated, 3 available, 2 old still running"


@pytest.mark.parametrize(
    ("stalled", "expected"), [(False, ("True", "WaitingForRollout")), (True, ("False", "RolloutStalled"))]
)
def test_a_policy_waiting_for_its_rollout_is_ready_unless_the_rollout_stalled(
    stalled: bool, expected: tuple[str, str]
) -> None:
    now = 1_800_000_000.0
    memory = PolicyMemory(watch=WorkloadWatch(rollout_generation=3, rollout_since=now - 30,
                                              rollout_stalled=stalled, rollout_summary=ROLLING))  # fmt: skip
    decision = effective_mode(Mode.APPLY, Mode.APPLY)
    capped = mode_condition(memory.tuning.conditions, decision, now)
    spec = KVTuningPolicySpec.model_validate(SPEC)
    note = f"waiting for rollout of Deployment inference/llama: {ROLLING}"
    prelude = Prelude(decision, capped, KvtuneAdminActuator("http://127.0.0.1:9", "unused"), None, [], None)
    outcome = waiting(memory, PolicyTick(PolicyRef("inference", "llama"), spec, now, 1), prelude, note, None)
    (found,) = [c for c in outcome.status.conditions if c.type == "Ready"]
    assert (found.status, found.reason) == expected and ROLLING in found.message
    assert outcome.status.timing is not None and outcome.status.timing.cooldown_seconds == 1800.0
