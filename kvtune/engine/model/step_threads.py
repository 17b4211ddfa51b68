"""How many threads each forward pass computes on: the engine's compute cores, or every core, chosen per
batch size by timing both.

`kvtune serve` computes on every core but one by default and leaves that one to HTTP (compute_threads). On a
quiet machine the spare core then idles through a long prefill chunk, whose GEMMs split across cores almost
perfectly; on a shared one, a second thread is often descheduled and every parallel region waits for it
(BENCHMARKS.md, issue 29). Neither width is right everywhere, so the runner measures: per batch-size class it
times steps at both widths, keeps the faster, and tries the other again now and then, since the load moves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

# Steps a width must be timed in, per class, before the faster is chosen...
TRIALS = 4
# ...unless it has SHORT_TRIALS steps adding up to TRIAL_SECONDS: long prefill chunks are measurements in
# themselves, and four on the slower width cost a short burst seconds (the small model's 2,000-token chunks
# take 1.4 s on two cores of this EPYC and 2.4 s on one). Two, compared by their minimum, so that one step
# slowed by something else (a first shape's setup, a neighbour) does not decide.
SHORT_TRIALS = 2
TRIAL_SECONDS = 0.2
# Every this many steps of a class, the width not in favour runs once, so a change in the machine's load is seen.
RETRY_EVERY = 24
# Each retry that confirms the verdict (it ran no faster than the favoured width's median) doubles the interval,
# up to this; one that contradicts it brings the interval back to RETRY_EVERY, so a change is followed as fast
# as before. On a steady machine the slower width then runs in 1 step of 192, not 1 of 24: in the tiny model's
# long burst on 2 cores, the two busiest classes (16-63 tokens) ran 137 steps on the slower width (8 of them
# trials), at 1.7-2.1x a step's time; now 28.
RETRY_MOST = 8 * RETRY_EVERY
# The per-token times kept per class and width: the median of the most recent ones decides.
KEPT = 9


@dataclass(frozen=True)
class Width:
    """A thread count and the cores its threads may run on (None: wherever the OS puts them)."""

    threads: int
    cores: frozenset[int] | None = None


def size_class(tokens: int) -> int:
    """Steps of a similar size share a verdict: 1, 2-3, 4-7, ... tokens (a power-of-two class)."""
    return max(1, tokens).bit_length()


@dataclass
class _ClassTimes:
    seconds_per_token: dict[int, deque[float]] = field(default_factory=dict)
    seconds_timed: dict[int, float] = field(default_factory=dict)
    retry_every: int = RETRY_EVERY
    since_retry: int = 0
    retrying: int | None = None  # while a retry is out: the width that was in favour when it was sent

    def times(self, threads: int) -> deque[float]:
        return self.seconds_per_token.setdefault(threads, deque(maxlen=KEPT))

    def tried(self, threads: int) -> bool:
        """Whether `threads` has been timed enough to be compared: TRIALS steps, or SHORT_TRIALS adding up to
        TRIAL_SECONDS."""
        timed = len(self.times(threads))
        long_enough = timed >= SHORT_TRIALS and self.seconds_timed.get(threads, 0.0) >= TRIAL_SECONDS
        return timed >= TRIALS or long_enough


class WidthChooser:
    """Pure: which of two thread counts the next step of a given size runs on, from the steps timed so far."""

    def __init__(self, narrow: int, wide: int) -> None:
        if not 0 < narrow < wide:
            raise ValueError(f"need 0 < narrow < wide threads, got {narrow} and {wide}")
        self.narrow, self.wide = narrow, wide
        self._classes: dict[int, _ClassTimes] = {}

    def threads_for(self, tokens: int) -> int:
        """Trials first (the width not yet tried, else the one with fewer timings), then the faster median; the
        other one once every `retry_every` steps of the class (RETRY_EVERY, backing off while it confirms)."""
        times = self._classes.setdefault(size_class(tokens), _ClassTimes())
        faster = self._favoured(times)
        if faster is None:
            if times.tried(self.narrow) != times.tried(self.wide):
                return self.wide if times.tried(self.narrow) else self.narrow
            narrow, wide = times.times(self.narrow), times.times(self.wide)
            return self.narrow if len(narrow) <= len(wide) else self.wide
        times.since_retry += 1
        if times.since_retry < times.retry_every:
            return faster
        times.since_retry, times.retrying = 0, faster
        return self.narrow if faster == self.wide else self.wide

    def record(self, tokens: int, threads: int, seconds: float) -> None:
        """A step of `tokens` tokens ran on `threads` threads in `seconds`."""
        if threads not in (self.narrow, self.wide) or seconds <= 0:
            return
        times = self._classes.setdefault(size_class(tokens), _ClassTimes())
        per_token = seconds / max(1, tokens)
        if times.retrying is not None and threads != times.retrying:  # the retry's own timing
            confirmed = per_token >= statistics.median(times.times(times.retrying))
            times.retry_every = min(2 * times.retry_every, RETRY_MOST) if confirmed else RETRY_EVERY
            times.retrying = None
        times.times(threads).append(per_token)
        times.seconds_timed[threads] = times.seconds_timed.get(threads, 0.0) + seconds

    def verdict(self, tokens: int) -> int | None:
        """The width in favour for steps of `tokens` tokens; None while still on trial."""
        times = self._classes.get(size_class(tokens))
        return None if times is None else self._favoured(times)

    def medians(self, tokens: int) -> dict[int, float]:
        """Per width, the median per-token seconds of the class's recent steps (widths not yet timed left out)."""
        times = self._classes.get(size_class(tokens))
        if times is None:
            return {}
        return {threads: statistics.median(kept) for threads, kept in times.seconds_per_token.items() if kept}

    def verdicts(self) -> dict[int, int | None]:
        """Per size class (its smallest token count), the width in favour; None while still on trial."""
        return {1 << (cls - 1): self._favoured(times) for cls, times in sorted(self._classes.items())}

    def _favoured(self, times: _ClassTimes) -> int | None:
        """The width with the lower median per-token time (the lower minimum while either has fewer than
        TRIALS timings), or None while either is still on trial."""
        if not (times.tried(self.narrow) and times.tried(self.wide)):
            return None
        narrow, wide = times.times(self.narrow), times.times(self.wide)
        typical = statistics.median if min(len(narrow), len(wide)) >= TRIALS else min
        return self.wide if typical(wide) < typical(narrow) else self.narrow


class StepThreads:
    """Applies the chooser around each forward pass: torch's thread count and the calling thread's cores.

    The engine thread's own cores are switched too: OpenMP's pool threads inherit the mask of the thread that
    starts them, so the wide width's extra thread must be started from a thread allowed on every core."""

    def __init__(self, narrow: Width, wide: Width) -> None:
        self.chooser = WidthChooser(narrow.threads, wide.threads)
        self._widths = {narrow.threads: narrow, wide.threads: wide}
        self._current: int | None = None
        self._announced: dict[int, int] = {}  # size class -> the width last logged for it

    def begin(self, tokens: int) -> int:
        """Set the width for a step of `tokens` tokens; returns its thread count."""
        threads = self.chooser.threads_for(tokens)
        if threads != self._current:
            width = self._widths[threads]
            if width.cores is not None and hasattr(os, "sched_setaffinity"):
                # pid 0: the calling (engine) thread; an OSError: the cores were taken away since boot
                # (a narrowed cpuset), so it runs wherever it may
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, width.cores)
            torch.set_num_threads(threads)
            self._current = threads
        return threads

    def end(self, tokens: int, threads: int, seconds: float) -> None:
        self.chooser.record(tokens, threads, seconds)
        self._announce(tokens)

    def _announce(self, tokens: int) -> None:
        """Log a class's width when it is first decided (INFO) and when the machine's load moves it (DEBUG):
        which width a CPU favours for which step sizes is what to read when its throughput surprises."""
        verdict = self.chooser.verdict(tokens)
        cls = size_class(tokens)
        if verdict is None or self._announced.get(cls) == verdict:
            return
        level = logging.DEBUG if cls in self._announced else logging.INFO
        self._announced[cls] = verdict
        low = 1 << (cls - 1)
        sizes = "1 token" if low == 1 else f"{low}-{2 * low - 1} tokens"
        timings = ", ".join(
            f"{threads} thread(s) {seconds * 1e6:,.1f} us/token"
            for threads, seconds in sorted(self.chooser.medians(tokens).items())
        )
        logger.log(level, "Steps of %s compute on %d thread(s) (medians: %s)", sizes, verdict, timings)
