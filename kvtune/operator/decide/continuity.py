"""Whether successive samples come from one process, so that what the operator reads between them is work
that happened and not a flip between sources.

A counter only grows inside one process. Each sample names the processes behind it (`identity_of`: their
process_start_time_seconds, by pod or instance where the source has one), and `judge` compares a sample
with the process the operator follows:
- the same process: no counter below its mark (the highest value it has shown);
- a restart: an identity not seen before, or, where the source exports no start time, counters that fell;
- an alternating source: an identity that was replaced answers again, a start time earlier than the
  followed process's, a counter that fell while the start time stayed, or (without start times) a counter
  that fell and then came back to where it was (a busy engine without a start time that restarts and
  preempts as much again within the horizon reads as one too: the cost is a hold, never an action). A `/metrics` URL behind a load-balanced Service, a
  scrape that hits a stale replica, a relay that answers for another process: each flip reads as a burst
  of work that never happened, and an operator that lowers on such evidence ratchets its values down.
The operator drops its samples at a restart or an alternation, never keeps a sample that sits below the
followed process's marks, and acts only once the source has answered from one process for a while
(`Continuity.holding`, used by `loop.step`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from kvtune.operator.decide.sample import Identity, Sample, identity_of

SAME, FIRST, RESTART, ALTERNATING = "same", "first", "restart", "alternating"
RETIRED_LIMIT = 8  # replaced processes remembered (an alternation among more sources is still caught)
ALTERNATING_HINT = (
    "the metrics URL answers from more than one process; point it at one pod or use podEndpoints"
)


@dataclass(frozen=True)
class Process:
    """One process as the operator last saw it: its identity, the highest value each counter (and each
    histogram's count) showed, and when. `fell`: the counters that fell when it was replaced, for a source
    without start times (a return of all of them to their marks is an alternation, not a restart)."""

    identity: Identity
    marks: Mapping[str, float]
    seen_at: float
    fell: frozenset[str] = frozenset()  # any of them back at its mark: the samples between were elsewhere


@dataclass(frozen=True)
class Continuity:
    """What `judge` keeps between samples: the followed process, the ones it replaced (newest last), and
    the last time the source answered inconsistently, with what it did."""

    current: Process | None = None
    retired: tuple[Process, ...] = ()
    anomaly_at: float | None = None
    anomaly: str | None = None

    def holding(self, now: float, hold_s: float) -> str | None:
        """Why no action may be taken now (the source alternated less than `hold_s` ago), or None."""
        if self.anomaly_at is None or now - self.anomaly_at >= hold_s:
            return None
        return self.anomaly


@dataclass(frozen=True)
class Judgement:
    kind: str  # SAME, FIRST, RESTART or ALTERNATING
    reason: str | None  # what the sample did (RESTART, ALTERNATING)
    continuity: Continuity
    keep: bool  # whether the sample belongs in the window (a stale one, below the marks, does not)


def figures(sample: Sample) -> dict[str, float]:
    """What only grows inside one process: the counters and each histogram's count."""
    found = dict(sample.counters)
    found.update({f"{name}_count": histogram.count for name, histogram in sample.histograms.items()})
    return found


def fallen(marks: Mapping[str, float], now: Mapping[str, float]) -> list[tuple[str, float, float]]:
    """(name, mark, value) of every figure below its mark, by name."""
    return sorted(
        (name, marks[name], value) for name, value in now.items() if name in marks and value < marks[name]
    )


def starts(identity: Identity) -> str:
    """An identity as a person reads it: `1712345678.25`, or `pod=a 1712345678.25, proxy 1712345700.00`."""
    return ", ".join(f"{who} {start:.2f}" if who else f"{start:.2f}" for who, start in identity) or "unknown"


def went_back(followed: Identity, now: Identity) -> str | None:
    """Why `now` cannot be a restart of `followed`: a process whose start time is earlier than before."""
    before = dict(followed)
    for who, start in now:
        if who in before and start < before[who]:
            name = f"{who}'s " if who else ""
            return (
                f"{name}process_start_time_seconds went back {before[who]:.2f} -> {start:.2f}: an older process "
                "answers after a newer one"
            )
    return None


def fell_text(fell: list[tuple[str, float, float]]) -> str:
    name, before, after = fell[0]
    more = f" (and {len(fell) - 1} more)" if len(fell) > 1 else ""
    return f"counter {name} fell {before:g} -> {after:g}{more}"


def _retire(continuity: Continuity, old: Process, new: Process) -> Continuity:
    return replace(continuity, current=new, retired=(*continuity.retired, old)[-RETIRED_LIMIT:])


def _alternate(
    continuity: Continuity, old: Process, new: Process, reason: str, answered: Process | None = None
) -> Judgement:
    """Follow `new` from now on. A replaced process whose identity answered again is no longer a replaced
    one; `answered` (a process known only by its counters) keeps, of the counters that fell, those not back
    yet: one flip back is one alternation, not one for every sample after it."""
    kept: list[Process] = []
    for process in continuity.retired:
        if new.identity and process.identity == new.identity:
            continue
        if process is answered:
            still_down = frozenset(
                n for n in process.fell if new.marks.get(n, float("-inf")) < process.marks[n]
            )
            if not still_down:
                continue
            process = replace(process, fell=still_down)
        kept.append(process)
    retired = _retire(replace(continuity, retired=tuple(kept)), old, new)
    return Judgement(ALTERNATING, reason, replace(retired, anomaly_at=new.seen_at, anomaly=reason), True)


def judge(continuity: Continuity, sample: Sample, horizon_s: float) -> Judgement:
    """`sample` against the followed process. Replaced processes are remembered for `horizon_s` seconds:
    one that answers again within it makes the source an alternating one. A sample that names fewer
    processes than the followed identity (a proxy beside the engine that did not answer this time) is a
    partial view of it, not another process."""
    at = sample.timestamp
    identity, marks = identity_of(sample), figures(sample)
    continuity = replace(
        continuity, retired=tuple(p for p in continuity.retired if at - p.seen_at <= horizon_s)
    )
    followed = continuity.current
    arrived = Process(identity, marks, at)
    if followed is None:
        return Judgement(FIRST, None, replace(continuity, current=arrived), True)
    if identity and followed.identity:
        back = went_back(followed.identity, identity)
        if back is not None:
            return _alternate(continuity, followed, arrived, back)
        known = dict(followed.identity)
        if any(known.get(who) != start for who, start in identity):  # a process moved, or one joined
            if any(p.identity == identity for p in continuity.retired):
                reason = (
                    f"the process started at {starts(identity)} answers again after the one started at "
                    f"{starts(followed.identity)}"
                )
                return _alternate(continuity, followed, arrived, reason)
            reason = f"process_start_time_seconds moved {starts(followed.identity)} -> {starts(identity)}"
            return Judgement(RESTART, reason, _retire(continuity, followed, arrived), True)
    fell = fallen(followed.marks, marks)
    if fell and followed.identity:
        # the start times stayed: the followed process's marks stand, and a sample under them is not its own
        reason = f"{fell_text(fell)} while process_start_time_seconds stayed {starts(followed.identity)}"
        return Judgement(ALTERNATING, reason, replace(continuity, anomaly_at=at, anomaly=reason), False)
    if fell:  # no start time to tell: a restart, unless the counters come back
        old = replace(followed, fell=frozenset(name for name, _, _ in fell))
        return Judgement(RESTART, fell_text(fell), _retire(continuity, old, arrived), True)
    for old in continuity.retired:
        returned = sorted(name for name in old.fell if marks.get(name, float("-inf")) >= old.marks[name])
        if returned:
            name = returned[0]
            reason = (
                f"counter {name} fell {old.marks[name]:g} -> {followed.marks.get(name, 0.0):g} and came back "
                f"to {marks[name]:g}: the samples between came from another process"
            )
            return _alternate(continuity, followed, arrived, reason, old)
    merged = {name: max(value, followed.marks.get(name, value)) for name, value in marks.items()}
    kept = Process(followed.identity or identity, {**followed.marks, **merged}, at)
    return Judgement(SAME, None, replace(continuity, current=kept), True)


def anomalies(samples: Iterable[Sample]) -> list[str]:
    """What made a run of samples (in time order) an alternating source, in order; empty when it came from
    one process at a time."""
    continuity, found = Continuity(), []
    for sample in samples:
        judged = judge(continuity, sample, float("inf"))
        continuity = judged.continuity
        if judged.kind == ALTERNATING and judged.reason is not None:
            found.append(judged.reason)
    return found
