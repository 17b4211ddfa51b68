"""The restart budget: at most `max_restarts` changes that restart a workload's pods in any `period_s`, and
optionally only inside a daily maintenance window (UTC). A GPU fleet's rolling restart reloads every
model, so a platform team bounds how often the operator may cause one, and when.

Pure: the times of the restarting changes already made and the time now go in; whether one more may be
made now, and from when, comes out. The tuner decides what to change; this decides whether a restart may
happen now (`loop.step` holds a change the budget does not allow, and decides again at the next tick).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS

DAY_S = 86400
WITHIN_BUDGET = "WithinBudget"
BUDGET_SPENT = "RestartBudgetSpent"
OUTSIDE_WINDOW = "OutsideMaintenanceWindow"


def clock_of(text: str) -> int:
    """Seconds after 00:00 of an "HH:MM" time of day."""
    hours, sep, minutes = text.partition(":")
    if not (sep and hours.isdigit() and minutes.isdigit() and len(hours) == len(minutes) == 2):
        raise ValueError(f"a time of day is HH:MM, got {text!r}")
    if not (0 <= int(hours) < 24 and 0 <= int(minutes) < 60):
        raise ValueError(f"a time of day is 00:00-23:59, got {text!r}")
    return int(hours) * 3600 + int(minutes) * 60


def clock_text(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}"


def when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def span(seconds: float) -> str:
    """A period as people say it: 24h, 90m, 45s."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:.0f}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:.0f}m"
    return f"{seconds:.0f}s"


@dataclass(frozen=True)
class MaintenanceWindow:
    """A daily time range in UTC, [start, end); one whose end is before its start spans midnight."""

    start_s: int  # seconds after 00:00 UTC when it opens
    end_s: int  # seconds after 00:00 UTC when it closes

    def __post_init__(self) -> None:
        if not (0 <= self.start_s < DAY_S and 0 <= self.end_s < DAY_S):
            raise ValueError("a maintenance window's start and end are times of day")
        if self.start_s == self.end_s:
            raise ValueError("a maintenance window needs an end different from its start")

    @staticmethod
    def of(start: str, end: str) -> MaintenanceWindow:
        return MaintenanceWindow(clock_of(start), clock_of(end))

    def contains(self, now: float) -> bool:
        of_day = now % DAY_S
        if self.start_s < self.end_s:
            return self.start_s <= of_day < self.end_s
        return of_day >= self.start_s or of_day < self.end_s

    def opens_after(self, now: float) -> float:
        """The first time at or after `now` at which the window is open."""
        if self.contains(now):
            return now
        opening = now - now % DAY_S + self.start_s
        return opening if opening > now else opening + DAY_S

    def describe(self) -> str:
        return f"{clock_text(self.start_s)}-{clock_text(self.end_s)} UTC"


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str  # WithinBudget, RestartBudgetSpent or OutsideMaintenanceWindow
    message: str
    next_at: float  # the first time a change may be made (now when allowed)


@dataclass(frozen=True)
class RestartBudget:
    max_restarts: int
    period_s: float
    window: MaintenanceWindow | None = None
    # the knobs whose change restarts the pods: vLLM's and SGLang's admission limit, a pod-template patch
    knobs: frozenset[str] = field(default_factory=lambda: frozenset({KNOB_MAX_NUM_SEQS}))

    def __post_init__(self) -> None:
        if self.max_restarts < 1 or self.period_s <= 0:
            raise ValueError("a restart budget allows at least one change in a positive period")

    def counting(self, changes: Iterable[float], now: float) -> tuple[float, ...]:
        """The changes that still count at `now`, oldest first: those less than a period ago. One stamped
        after `now` counts too, so a clock that stepped back never frees the budget."""
        return tuple(sorted(at for at in changes if at > now - self.period_s))

    def next_allowed(self, changes: Iterable[float], now: float) -> float:
        """The first time at or after `now` at which one more change is allowed, if none is made before."""
        counted = self.counting(changes, now)
        at = now
        if len(counted) >= self.max_restarts:
            # at time x a change made at t counts while t > x - period: the oldest ones must age out
            at = max(at, counted[len(counted) - self.max_restarts] + self.period_s)
        return self.window.opens_after(at) if self.window is not None else at

    def verdict(self, changes: Iterable[float], now: float) -> Verdict:
        """Whether a change that restarts the pods may be made at `now`, and if not, why and from when."""
        kept = tuple(changes)
        counted = self.counting(kept, now)
        used = self.usage(counted, now)
        if self.window is not None and not self.window.contains(now):
            at = self.next_allowed(kept, now)
            return Verdict(False, OUTSIDE_WINDOW, f"outside the maintenance window {self.window.describe()}; "
                           f"{used}; the next change at {when(at)}", at)  # fmt: skip
        if len(counted) >= self.max_restarts:
            at = self.next_allowed(kept, now)
            return Verdict(False, BUDGET_SPENT, f"{used}; the next change at {when(at)}", at)
        return Verdict(True, WITHIN_BUDGET, used, now)

    def record(self, changes: Iterable[float], now: float) -> tuple[float, ...]:
        """The changes to remember after one made at `now`: the last `max_restarts` that still count (older
        ones can no longer decide a verdict)."""
        return (*self.counting(changes, now), now)[-self.max_restarts :]

    def usage(self, counted: tuple[float, ...], now: float) -> str:
        window = f", inside {self.window.describe()}" if self.window is not None else ""
        return (
            f"{min(len(counted), self.max_restarts)} of {self.max_restarts} restarts used in the last "
            f"{span(self.period_s)}{window}"
        )

    def describe(self, changes: Iterable[float], now: float) -> str:
        return self.usage(self.counting(changes, now), now)
