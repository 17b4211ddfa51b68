"""When a fact about a policy's engine starts, changes and ends: no data, an alternating source, corrupt
series, the proxy's metrics missing, no actuator, a capped mode, pods that disagree, a held change. Each is
reported at its edges, never once per tick; the cluster posts the reports as Events (`k8s.events`), the
--local loop logs them (`io.local_metrics`), with the same words. Pure: values in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kvtune.operator.decide.continuity import ALTERNATING_HINT
from kvtune.operator.decide.diagnosis import corrupt_text
from kvtune.operator.decide.loop import Tick

FindingKind = Literal[
    "mode_capped",
    "actuator_unavailable",
    "pods_disagree",
    "proxy_missing",
    "alternating",
    "no_data",
    "corrupt",
    "change_held",
]
Edge = Literal["started", "changed", "ended"]


@dataclass(frozen=True)
class Fact:
    """A finding that holds at this tick: `key` tells one occurrence from another (a new key while it holds
    is a change; an empty key never changes), `text` is what the report says."""

    key: str
    text: str


Facts = Mapping[FindingKind, Fact | None]  # None: it does not hold; a kind left out was not looked at
On = Mapping[FindingKind, str]  # the findings that held when last looked at, by their keys


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    edge: Edge
    message: str


# What a finding says when it starts or changes (its text put into the template), and when it ends.
STARTED: dict[FindingKind, str] = {
    "mode_capped": "{}",
    "actuator_unavailable": "{}",
    "pods_disagree": "{}",
    "proxy_missing": "the proxy's /metrics (defeat and cap series) cannot be read: {}",
    "alternating": ALTERNATING_HINT + ": {}; its samples are dropped and nothing is acted on until it "
    "answers from one process",
    "no_data": "no data from the metrics source: {}",
    "corrupt": "corrupt metrics, dropped and never used as figures: {}",
    "change_held": "{}",
}
ENDED: dict[FindingKind, str] = {
    "mode_capped": "runs as spec.mode asks again",
    "actuator_unavailable": "what acts on the engine's knobs is built",
    "pods_disagree": "the pods agree again, and every pod is read",
    "proxy_missing": "the proxy's /metrics can be read again",
    "alternating": "the metrics source has answered from one process long enough: tuning resumes",
    "no_data": "the metrics source answers again",
    "corrupt": "no corrupt metrics now",
    "change_held": "no change held now",
}


def transitions(before: On, facts: Facts) -> tuple[dict[FindingKind, str], list[Finding]]:
    """The findings on after this tick, and a report for each that started, changed or ended (in the order
    of `facts`); a kind `facts` leaves out is kept as it was."""
    after = dict(before)
    found: list[Finding] = []
    for kind, fact in facts.items():
        was = before.get(kind)
        if fact is None:
            after.pop(kind, None)
            if was is not None:
                found.append(Finding(kind, "ended", ENDED[kind]))
            continue
        after[kind] = fact.key
        if was is None or was != fact.key:
            found.append(
                Finding(kind, "started" if was is None else "changed", STARTED[kind].format(fact.text))
            )
    return after, found


def fact(text: str | None) -> Fact | None:
    """A finding told by its text, which changes when the text does."""
    return None if not text else Fact(text, text)


def steady(text: str | None) -> Fact | None:
    """A finding that is on or off: a new text while it holds is not a change."""
    return None if not text else Fact("", text)


def tick_facts(tick: Tick, held: bool = True) -> dict[FindingKind, Fact | None]:
    """What one step found about the source and the engine. Whether the source alternates is not looked at
    without data; a held change only where a change can restart the pods (`held`)."""
    corrupt = tick.decision.diagnosis.corrupt if tick.decision is not None else ()
    facts: dict[FindingKind, Fact | None] = {}
    if tick.no_data is None:
        facts["alternating"] = steady(tick.alternation or tick.holding) if tick.holding is not None else None
    facts["no_data"] = steady(tick.no_data)
    facts["corrupt"] = fact(corrupt_text(corrupt))
    if held:
        facts["change_held"] = (
            Fact(tick.held.verdict.reason, tick.held.text) if tick.held is not None else None
        )
    return facts
