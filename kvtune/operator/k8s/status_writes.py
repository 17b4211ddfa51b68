"""When a policy's status is written. Every change that means something (a condition's state, a knob, the
history, the tuner's memory, an undo, the rollout watched) is written at the evaluation that makes it; the
figures that move every tick (the note, each pod's usage, the evaluation time) ride along, and on their own
are written again only every `refresh` seconds. Kubernetes moved node heartbeats out of status into Leases
for the same reason: a fleet of objects rewritten every few seconds is most of the API server's writes.
The operator's own `kvtune_operator_last_evaluation_timestamp_seconds` says when each policy last ran.

The refresh keeps the status writes of all policies within `STATUS_SHARE` of the client's rate limit:
none for a handful of policies (every evaluation is written), about a minute at 500 policies, 20 a second."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

STATUS_SHARE = 0.5  # of the client-side QPS, for writes that only refresh figures
VOLATILE = ("lastEvaluationTime", "note", "pods", "worstPod")


def refresh_seconds(policies: int, qps: float, interval: float) -> float:
    """How long a status whose meaning has not changed may wait for its next write: 0 (every evaluation)
    while the fleet's refreshes fit the share of the rate limit, else as long as it takes them to fit."""
    if qps <= 0 or policies <= 0:
        return 0.0
    spacing = policies / (qps * STATUS_SHARE)
    return 0.0 if spacing <= interval else spacing


def meaning(status: dict[str, Any]) -> str:
    """The status less what moves at every evaluation: conditions by type, status and reason (their
    messages quote figures), the prediction less the rate it observed, the scaling less its evaluation time."""
    kept = {key: value for key, value in status.items() if key not in VOLATILE}
    kept["conditions"] = [
        (c.get("type"), c.get("status"), c.get("reason")) for c in status.get("conditions") or []
    ]
    if isinstance(kept.get("prediction"), dict):
        kept["prediction"] = {
            k: v for k, v in kept["prediction"].items() if k != "observedPreemptionsPerMinute"
        }
    if isinstance(kept.get("scaling"), dict):
        kept["scaling"] = {k: v for k, v in kept["scaling"].items() if k != "evaluatedAt"}
    return json.dumps(kept, sort_keys=True, default=str)


@dataclass
class StatusWrites:
    """The last status written of one policy: its meaning and when."""

    written: str | None = None
    at: float | None = None

    def due(self, status: dict[str, Any], now: float, refresh: float) -> bool:
        if self.written is None or self.at is None or now - self.at >= refresh:
            return True
        return meaning(status) != self.written

    def wrote(self, status: dict[str, Any], now: float) -> None:
        self.written, self.at = meaning(status), now

    def failed(self) -> None:
        """The write did not land: the next evaluation writes whatever it finds."""
        self.written, self.at = None, None
