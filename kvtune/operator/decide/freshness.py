"""A change is made on fresh data or not at all: an evaluation's writes must land within one interval of the
data it decided on. A write that would land later (the API server or etcd away, and the call waiting or
retried) is not made; it is reported as a failed apply, and the next evaluation decides again on what it
reads then. Without this, a patch held through an outage lands after the world it was decided on has
moved, and the next evaluation's reading of it is no longer the one the history says.

Pure: the time is passed in (the actuator holds the clock)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Freshness:
    """The data an evaluation decided on: read at `read_at` (the evaluation's start, so never later than
    the read itself), usable for `interval_s` (the policy's interval)."""

    read_at: float
    interval_s: float

    @property
    def deadline(self) -> float:
        """The last moment a write decided on this data may land."""
        return self.read_at + self.interval_s

    def remaining(self, now: float) -> float:
        """How long a write made at `now` may take, at most, to still land in time (<= 0: too late)."""
        return self.deadline - now

    def stale(self, now: float) -> str | None:
        """Why a write at `now` may not be made (the data is older than one interval), or None when it may."""
        age = now - self.read_at
        if age < self.interval_s:
            return None
        return (
            f"decided on data {age:.1f} s old, more than one interval ({self.interval_s:g} s): not applied; "
            "the next evaluation decides again"
        )
