"""Turns the operator's ticks into the demo's timeline: one Point per tick, one Action per new entry in the
tuner's history (what `kvtune operator --local` logs), plus the knob values it put back after a restart."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvtune.contract import metrics as m
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.demo.timeline import Action, Point
from kvtune.operator.decide.loop import Tick
from kvtune.operator.decide.ports import MetricSource
from kvtune.operator.decide.sample import NoData, Sample, SampleResult

RUNG_OF_KNOB = {KNOB_MAX_TOKENS_CAP: "cap_max_tokens", KNOB_MAX_NUM_SEQS: "lower_max_num_seqs"}


class RecordingSource:
    """The operator's metric source, keeping the sample each tick read so the recorder sees the same one."""

    def __init__(self, source: MetricSource) -> None:
        self.source = source
        self.last: Sample | None = None

    @property
    def proxy_problem(self) -> str | None:
        return self.source.proxy_problem

    def read(self) -> SampleResult:
        result = self.source.read()
        if not isinstance(result, NoData):
            self.last = result
        return result


def _rate(now: Sample, before: Sample | None, key: str) -> float | None:
    """Per-second increase of a counter between two samples; None across a restart (the counter fell)."""
    if before is None or key not in now.counters or key not in before.counters:
        return None
    span = now.timestamp - before.timestamp
    delta = now.counters[key] - before.counters[key]
    return delta / span if span > 0 and delta >= 0 else None


def _delta(now: Sample, before: Sample | None, key: str) -> float | None:
    """A counter's increase between two samples; None across a restart (the counter fell)."""
    if before is None or key not in now.counters or key not in before.counters:
        return None
    delta = now.counters[key] - before.counters[key]
    return delta if delta >= 0 else None


@dataclass
class Recorder:
    source: RecordingSource
    started: float  # epoch seconds the demo started
    phase: str = "1 cap max_tokens"

    def __post_init__(self) -> None:
        # (seconds since the start, phase) at each change: what was under way when a point or a failure came
        self.phases: list[tuple[float, str]] = [(round(time.time() - self.started, 2), self.phase)]
        self.points: list[Point] = []
        self.actions: list[Action] = []
        self.lock = threading.Lock()
        self._seen: set[tuple[float, str, str, object]] = set()
        self._previous: Sample | None = None

    def enter(self, phase: str) -> None:
        """The demo moves to its next phase: points from now on carry it, and the change is logged."""
        self.phase = phase
        with self.lock:
            self.phases.append((round(time.time() - self.started, 2), phase))

    def add_action(self, action: Action) -> None:
        with self.lock:
            self.actions.append(action)

    def observe(self, sample: Sample, max_num_seqs: int | None, max_tokens_cap: int | None) -> None:
        """A Point before the operator runs: the engine in trouble, at the knobs it was started with."""
        if sample is not self._previous:
            self._point(sample, max_num_seqs, max_tokens_cap)

    def __call__(self, tick: Tick) -> None:
        sample = self.source.last
        if sample is not None and sample is not self._previous:
            engine = tick.engine
            self._point(
                sample, engine.max_num_seqs if engine else None, engine.max_tokens_cap if engine else None
            )
        for entry in tick.state.history:
            key = (entry.at, entry.kind, entry.remedy.value, entry.after)
            if key in self._seen:
                continue
            self._seen.add(key)
            self.add_action(Action(round(entry.at - self.started, 1), entry.remedy.value, entry.kind,
                                   entry.knob, entry.before, entry.after, entry.evidence))  # fmt: skip
        for knob, value, outcome in tick.reapplied:
            if outcome.ok:
                evidence = "the operator put its desired value back on the restarted engine"
                self.add_action(Action(round(tick.at - self.started, 1), RUNG_OF_KNOB.get(knob, knob),
                                       "applied", knob, None, value, evidence))  # fmt: skip

    def _point(self, sample: Sample, max_num_seqs: int | None, max_tokens_cap: int | None) -> None:
        before = self._previous
        self._previous = sample
        queries, hits = _delta(sample, before, m.PREFIX_QUERIES), _delta(sample, before, m.PREFIX_HITS)
        preemptions = _rate(sample, before, m.PREEMPTIONS)
        throughput = _rate(sample, before, m.GENERATION_TOKENS)
        point = Point(
            t=round(sample.timestamp - self.started, 2),
            phase=self.phase,
            kv_usage=sample.gauges.get(m.KV_USAGE),
            preemptions_per_s=None if preemptions is None else round(preemptions, 3),
            throughput=None if throughput is None else round(throughput, 1),
            hit_rate=hits / queries if queries and hits is not None else None,
            max_num_seqs=max_num_seqs,
            max_tokens_cap=max_tokens_cap,
            running=sample.gauges.get(m.RUNNING),
            waiting=sample.gauges.get(m.WAITING),
            prefix_queries=queries,
            prefix_hits=hits,
            preemptions=_delta(sample, before, m.PREEMPTIONS),
        )
        with self.lock:
            self.points.append(point)
