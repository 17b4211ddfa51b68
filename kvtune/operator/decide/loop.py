"""The loop both modes run (`kvtune operator --local` against one engine, and `k8s.reconcile` for each
KVTuningPolicy): sample, decide, act, log, every interval. It sees the world only through `ports`.

The pure `decide` is called here. An actuator failure is logged and the tuner's state
is left as it was, so the change is simply tried again when still called for. The operator owns the values
it set (`TunerState.desired`): when the engine restarts (`continuity.judge`) the samples of the old
process are dropped, and whenever the engine does not hold a desired value (a restart, an operator that
resumed from status) it is put back at once, before any new evidence.

A change that restarts the workload's pods (vLLM's and SGLang's max_num_seqs, a pod-template patch) is
made only when the policy's restart budget allows it (`restart_budget`): otherwise it is held, the tuner's
state stays as it was, and the change is decided again, on fresher evidence, at the next tick.

A source that answers from more than one process (`continuity`: a Service in front of several pods, a
stale replica, a relay) is said at once, its samples are dropped, a sample below the followed process's
counters is never kept, and no action is taken until it has answered from one process for `hold_s`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvtune.operator.decide import scaling
from kvtune.operator.decide.continuity import ALTERNATING, ALTERNATING_HINT, RESTART, Continuity, judge
from kvtune.operator.decide.diagnosis import diagnose
from kvtune.operator.decide.ladder import rungs
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.ports import Actuator, ActuatorResult, MetricSource
from kvtune.operator.decide.restart import drifted, pool_changed
from kvtune.operator.decide.restart_budget import Verdict
from kvtune.operator.decide.sample import EngineView, NoData, Sample, engine_view_from_sample
from kvtune.operator.decide.tuner import Change, Decision, TunerState, Value, decide
from kvtune.operator.decide.window import Window

logger = logging.getLogger("kvtune.operator")


@dataclass(frozen=True)
class Held:
    """A change the restart budget held: what it was, and the budget's verdict (why, and from when)."""

    what: str
    verdict: Verdict

    @property
    def text(self) -> str:
        """How the held change is said, in its finding and in the Ready condition alike."""
        return f"{self.what} held: {self.verdict.message}"


@dataclass(frozen=True)
class Tick:
    """One iteration of the loop, for logs, tests and benchmarks."""

    at: float
    decision: Decision | None
    applied: tuple[tuple[Change, ActuatorResult], ...] = ()
    no_data: str | None = None
    state: TunerState = field(default_factory=TunerState)
    restart: str | None = None  # why the engine is judged to have restarted since the last sample
    reapplied: tuple[tuple[str, Value, ActuatorResult], ...] = ()  # desired values put back this tick
    evidence_since: float | None = None  # the oldest sample the decision could see
    engine: EngineView | None = None  # the engine at the end of the tick, after any change it made
    alternation: str | None = None  # what made the source an alternating one at this tick
    holding: str | None = None  # why no action may be taken yet: the source alternated too recently
    held: Held | None = None  # a change that restarts the pods, held: the restart budget does not allow it


HOLD_WINDOWS = 3  # an alternating source must answer from one process this many windows before any action
RETIRED_WINDOWS = 20  # a replaced process that answers again within this many windows makes it alternating


def window_length(policy: TuningPolicy, interval: float) -> int:
    """Samples kept: enough to cover an evaluation window or a cooldown, whichever is longer."""
    span = max(policy.evaluation_window_s, policy.cooldown_s)
    return max(3, math.ceil(span / interval) + 2)


def hold_seconds(policy: TuningPolicy) -> float:
    """How long a source must answer from one process, after it alternated, before the operator acts."""
    return HOLD_WINDOWS * max(policy.evaluation_window_s, policy.cooldown_s)


def horizon_seconds(policy: TuningPolicy) -> float:
    """How long a replaced process is remembered: its answering again within it is an alternation."""
    return RETIRED_WINDOWS * max(policy.evaluation_window_s, policy.cooldown_s)


def followed(state: TunerState, samples: Iterable[Sample], horizon_s: float) -> Continuity:
    """The source as the state knows it; when it knows nothing yet (a new state beside a kept window),
    as the window's samples tell it."""
    if state.source.current is not None:
        return state.source
    continuity = Continuity()
    for sample in samples:
        continuity = judge(continuity, sample, horizon_s).continuity
    return continuity


def live_view(sample: Sample, knobs: frozenset[str], current: ActuatorResult) -> EngineView:
    """The engine as its metrics describe it, with the knob values the actuator read back (authoritative:
    the gauges only move when the engine steps)."""
    known = EngineView(knobs=knobs)
    if current.ok:
        known = EngineView(
            max_num_seqs=current.values.get("max_num_seqs"),
            max_tokens_cap=current.values.get("max_tokens_cap"),
            knobs=knobs,
        )
    view = engine_view_from_sample(sample, known)
    if current.ok and current.values.get("max_tokens_cap") is None:
        view = EngineView(**{**view.__dict__, "max_tokens_cap": None})
    return view


def after_calls(current: ActuatorResult, calls: Iterable[ActuatorResult]) -> ActuatorResult:
    """The knob values once `calls` are done: what `current` read, updated by each successful call (an
    actuator answers with the values it holds after the call), so a tick reads the actuator only once."""
    values = dict(current.values) if current.ok else {}
    done = [call for call in calls if call.ok]
    for call in done:
        values.update(call.values)
    ok = current.ok or bool(done)
    return ActuatorResult(ok, values, None if ok else current.error)


def budget_verdict(policy: TuningPolicy, state: TunerState, knob: str, now: float) -> Verdict | None:
    """Why a change of `knob` may not be made now (the policy's restart budget), or None when it may."""
    budget = policy.restart_budget
    if budget is None or knob not in budget.knobs:
        return None
    verdict = budget.verdict(state.restarts, now)
    return None if verdict.allowed else verdict


def spend(policy: TuningPolicy, state: TunerState, knob: str, now: float) -> TunerState:
    """The state once a change of `knob` was made: a change that restarts the pods counts against the budget."""
    budget = policy.restart_budget
    if budget is None or knob not in budget.knobs:
        return state
    return replace(state, restarts=budget.record(state.restarts, now))


@dataclass(frozen=True)
class Reapplied:
    done: tuple[tuple[str, Value, ActuatorResult], ...] = ()
    state: TunerState = field(default_factory=TunerState)  # with the restarts the re-applies made
    held: Held | None = None  # a re-apply that would restart the pods, held by the restart budget


def reapply_desired(
    actuator: Actuator, policy: TuningPolicy, state: TunerState, current: ActuatorResult, now: float
) -> Reapplied:
    """Put back every desired value the engine does not hold (`current`, read this tick; Apply mode only),
    or that not every pod holds (`current.split`); failures are logged and simply tried again next tick, as
    is a re-apply the restart budget holds."""
    desired = {knob: value for knob, value in state.desired if knob in actuator.knobs}
    if policy.mode is not Mode.APPLY or not desired or not current.ok:
        return Reapplied(state=state)
    done: list[tuple[str, Value, ActuatorResult]] = []
    held: Held | None = None
    split = {knob: value for knob, value in desired.items() if knob in current.split}  # pods disagree
    for knob, value in {**drifted(desired, dict(current.values)), **split}.items():
        verdict = budget_verdict(policy, state, knob, now)
        if verdict is not None:
            logger.info("holding the re-apply of %s=%s: %s", knob, value, verdict.message)
            held = Held(f"re-applying {knob}={value}", verdict)
            continue
        outcome = actuator.apply(knob, value, f"re-applying {knob}={value}, which the operator set and holds")
        done.append((knob, value, outcome))
        if outcome.ok:
            state = spend(policy, state, knob, now)
            logger.info("re-applied %s=%s (the engine held %s)", knob, value, current.values.get(knob))
        else:
            logger.error("could not re-apply %s=%s: %s", knob, value, outcome.error)
    return Reapplied(tuple(done), state, held)


def step(
    source: MetricSource,
    actuator: Actuator,
    policy: TuningPolicy,
    state: TunerState,
    samples: deque[Sample],
    now: float,
) -> Tick:
    """Read one sample, decide, apply what the decision says; returns the tick with the new state. The
    actuator's values are read once, and followed through the changes the tick makes."""
    result = source.read()
    if isinstance(result, NoData):
        logger.warning("no data from %s: %s", result.source, result.reason)
        return Tick(now, None, no_data=result.reason, state=state)
    hold = hold_seconds(policy)
    judged = judge(followed(state, samples, horizon_seconds(policy)), result, horizon_seconds(policy))
    state = replace(state, source=judged.continuity)
    restart = judged.reason if judged.kind == RESTART else None
    alternation = judged.reason if judged.kind == ALTERNATING else None
    if restart is not None:
        logger.warning(
            "engine restarted (%s): dropping the %d samples taken before it", restart, len(samples)
        )
        resized = pool_changed(samples[-1], result) if samples else None
        samples.clear()
        state = state.after_engine_restart(now)
        if resized is not None:
            logger.warning("%s: max_num_seqs is sized again for the new pool", resized)
            state = state.after_pool_change()
    if alternation is not None:
        logger.warning(
            "%s (%s): dropping the %d samples taken before it; no action until it has answered from one "
            "process for %.0f s", ALTERNATING_HINT, alternation, len(samples), hold,
        )  # fmt: skip
        samples.clear()
        state = state.after_engine_restart(now)
    if judged.keep:
        samples.append(result)
    current = actuator.current()
    again = reapply_desired(actuator, policy, state, current, now)
    reapplied, state, held = again.done, again.state, again.held
    current = after_calls(current, (outcome for _, _, outcome in reapplied))
    engine = live_view(samples[-1] if samples else result, actuator.knobs, current)
    window = Window.of(samples)
    holding = state.source.holding(now, hold)
    if holding is not None:
        note = f"holding every action: {ALTERNATING_HINT} ({holding})"
        decision, new_state = Decision(diagnose(window, engine), note=note), state
    else:
        decision, new_state = decide(window, engine, policy, state, now)
    for advice in decision.advice:
        logger.info(
            "%s: %s -> %s (%s)", advice.remedy.value, advice.current, advice.recommended, advice.evidence
        )
    applied: list[tuple[Change, ActuatorResult]] = []
    for change in decision.changes:
        verdict = budget_verdict(policy, state, change.knob, now)
        if verdict is not None:  # not made: the same state decides again next tick, on fresher evidence
            logger.info("holding %s %s -> %s: %s", change.knob, change.before, change.value, verdict.message)
            what = f"{change.remedy.value} {change.knob} {change.before} -> {change.value}"
            held, new_state = Held(what, verdict), state
            decision = replace(decision, note=f"held {what}: {verdict.message}")
            continue
        outcome = actuator.apply(change.knob, change.value, f"{change.remedy.value}: {change.reason}")
        applied.append((change, outcome))
        if outcome.ok:
            new_state = spend(policy, new_state, change.knob, now)
            logger.info(
                "applied %s: %s -> %s (%s): %s", change.knob, change.before, change.value,
                change.remedy.value, change.reason,
            )  # fmt: skip
        else:
            logger.error("could not apply %s=%s: %s", change.knob, change.value, outcome.error)
            new_state = state
    if holding is None:
        tuned = window.since(new_state.last_action_at)
        scaled = scaling.evaluate(
            tuned, engine, policy, new_state.pending is not None, new_state.scaling, now
        )
        new_state = replace(new_state, scaling=scaled)
    since = window.samples[0].timestamp if window.samples else now
    shown = samples[-1] if samples else result
    after = live_view(shown, actuator.knobs, after_calls(current, (outcome for _, outcome in applied)))
    decision = replace(decision, rungs=rungs(decision.diagnosis, after, policy))
    return Tick(now, decision, tuple(applied), state=new_state, restart=restart, reapplied=reapplied,
                evidence_since=since, engine=after, alternation=alternation, holding=holding,
                held=held)  # fmt: skip


def run_loop(
    source: MetricSource,
    actuator: Actuator,
    policy: TuningPolicy,
    interval: float,
    stop: threading.Event,
    on_tick: Callable[[Tick], None] | None = None,
    clock: Callable[[], float] = time.time,
) -> TunerState:
    """Run until `stop` is set; every tick goes to `on_tick`."""
    state = TunerState()
    samples: deque[Sample] = deque(maxlen=window_length(policy, interval))
    while not stop.is_set():
        started = time.monotonic()
        tick = step(source, actuator, policy, state, samples, clock())
        state = tick.state
        if on_tick is not None:
            on_tick(tick)
        stop.wait(max(0.0, interval - (time.monotonic() - started)))
    return state
