"""One measurement of a setting under load (`static_window`), and one rule for the sweep-best (`confirmed_best`).

A static window sets max_num_seqs through the engine's admin API, lets it settle, and scrapes /metrics every
second over the window: goodput (the engine's generation-tokens counter per second: a preempted request keeps its
output, so no counted token is thrown away), delivered (finished requests' generation tokens per second), tokens
per engine CPU-second, preemptions and the operating point. A setting the engine does not take is tried again and
then raises: a window is never measured at a value that was not applied.

The sweep-best is the best goodput among the values no window saw preempt: the sweep's two passes (rising, then
falling), then one long confirming window (the preemption alert's span: a value that preempts there would page);
a value that preempts in any of its windows is no clean value and the sweep-best is chosen again. When no value
of the sweep stays clean, the sweep is extended downward, one value at a time, to 1 if need be.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvtune.bench.whatif_window import Reading, metrics_window
from kvtune.bench.workloads import Workload
from kvtune.core.step_time import OperatingPoint
from kvtune.core.workload_fit import operating_point
from kvtune.errors import KvtuneError
from kvtune.harness.engine_process import start_engine, write_tiny_model_in_subprocess
from kvtune.harness.server import ServerProcess
from kvtune.operator.decide.ports import ActuatorResult
from kvtune.operator.decide.sample import NoData, sample_from_series
from kvtune.operator.io.actuators import KvtuneAdminActuator
from kvtune.operator.io.sources import MetricsEndpoint

TOKEN = "bench-tuner-token"  # the admin token of the benchmarks' engines
ATTEMPTS = 3  # a machine shared with other jobs can starve the engine past one HTTP timeout
HTTP_TIMEOUT_S = 30.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), NaN where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Window:
    """One measured window of a static max_num_seqs value."""

    max_num_seqs: int
    seconds: float
    goodput: float  # generation tokens per second (the engine's counter)
    per_cpu_s: float  # generation tokens per CPU-second of the engine process
    preemptions: float
    point: OperatingPoint | None = None
    cpu_share: float = math.nan  # engine CPU-seconds per second of the window
    delivered: float = math.nan  # generation tokens of finished requests per second


def combined(windows: Sequence[Window]) -> Window:
    """Windows of one static value as one: mean rates, every preemption any saw, the spans summed."""
    return Window(
        windows[0].max_num_seqs,
        sum(w.seconds for w in windows),
        statistics.fmean(w.goodput for w in windows),
        statistics.fmean(w.per_cpu_s for w in windows),
        sum(w.preemptions for w in windows),
        delivered=statistics.fmean(w.delivered for w in windows),
    )


def time_weighted(windows: Sequence[Window]) -> tuple[float, float, float]:
    """One value's goodput and goodput per engine CPU-second over all its windows, each weighted by its
    span, and the total span: a 300 s confirming window outweighs a 6 s round fifty to one, as it should
    (one value's 6 s rounds spread by a third on this machine, BENCHMARKS.md)."""
    total = sum(w.seconds for w in windows)
    if not windows or not total > 0:
        return math.nan, math.nan, 0.0
    goodput = sum(w.goodput * w.seconds for w in windows) / total
    per_cpu = sum(w.per_cpu_s * w.seconds for w in windows) / total
    return goodput, per_cpu, total


class Engine(Protocol):
    """What a static window needs of an engine under load: a max_num_seqs setter and a measured window."""

    def apply(self, value: int) -> ActuatorResult: ...

    def window(self, value: int, seconds: float) -> Window: ...


@dataclass(frozen=True)
class LiveEngine:
    """A running engine, read through /metrics and set through its admin API."""

    source: MetricsEndpoint
    actuator: KvtuneAdminActuator
    pid: int

    @classmethod
    def of(cls, server: ServerProcess) -> LiveEngine:
        return cls(
            MetricsEndpoint(server.url, timeout=HTTP_TIMEOUT_S),
            KvtuneAdminActuator(server.url, TOKEN, timeout=HTTP_TIMEOUT_S),
            server.process.pid,
        )

    def apply(self, value: int) -> ActuatorResult:
        return self.actuator.apply("max_num_seqs", value)

    def read(self) -> Reading:
        series = self.source.series()
        for _ in range(ATTEMPTS - 1):
            if not isinstance(series, NoData):
                break
            series = self.source.series()
        if isinstance(series, NoData):
            raise KvtuneError(f"the engine's /metrics stopped answering: {series.reason}")
        sample = sample_from_series(series, time.time(), self.source.url)
        if isinstance(sample, NoData):
            raise KvtuneError(f"the engine's /metrics held nothing the operator reads: {sample.reason}")
        return Reading(sample, tuple(series))

    def scraped(self, seconds: float) -> list[Reading]:
        """One reading now and one every second for `seconds`."""
        readings = [self.read()]
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            time.sleep(max(0.0, min(1.0, seconds - (time.monotonic() - began))))
            readings.append(self.read())
        return readings

    def window(self, value: int, seconds: float) -> Window:
        cpu_before = cpu_seconds(self.pid)
        readings = self.scraped(seconds)
        cpu = cpu_seconds(self.pid) - cpu_before
        window = metrics_window(readings)
        first, last = window.scrapes[0], window.scrapes[-1]
        span = last.at - first.at
        generated = last.generated_tokens - first.generated_tokens
        point = None
        if window.prompt_len and window.output_len and window.prompt_len.count and window.output_len.count:
            mean_prompt = window.prompt_len.total / window.prompt_len.count
            mean_output = window.output_len.total / window.output_len.count
            point = operating_point(window.scrapes, mean_prompt, mean_output, 0.0, window.inter_token_latency)
        delivered = window.output_len.total if window.output_len is not None else 0.0
        return Window(value, span, generated / span, generated / cpu if cpu > 0 else math.nan,
                      last.preemptions - first.preemptions, point, cpu / span, delivered / span)  # fmt: skip


@contextmanager
def engine_for(workload: Workload) -> Iterator[ServerProcess]:
    """`kvtune serve` (tiny model) with the workload's pool, at its start value, stopped on the way out."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "token").write_text(TOKEN)
        model = write_tiny_model_in_subprocess(folder / "tiny")
        engine = start_engine(model, folder / "token", folder / "engine.log", "--kv-cache-tokens",
                              str(workload.kv_cache_tokens), "--max-num-seqs", str(workload.start))  # fmt: skip
        try:
            yield engine
        finally:
            engine.stop()


def set_max_num_seqs(engine: Engine, value: int) -> None:
    """Set the value, trying again where the engine did not answer; raises when it cannot be applied."""
    outcome = engine.apply(value)
    for _ in range(ATTEMPTS - 1):
        if outcome.ok:
            return
        outcome = engine.apply(value)
    if not outcome.ok:
        raise KvtuneError(f"setting max_num_seqs {value} failed {ATTEMPTS} times: {outcome.error}")


def static_window(
    engine: Engine, value: int, seconds: float, *, settle: float, label: str = "static"
) -> Window:
    """max_num_seqs = `value` under the running load: set (or raise), `settle` seconds, then `seconds` measured."""
    set_max_num_seqs(engine, value)
    time.sleep(settle)
    w = engine.window(value, seconds)
    print(f"  {label} max_num_seqs {value}: goodput {w.goodput:.0f} tokens/s (delivered {w.delivered:.0f}, "
          f"{w.per_cpu_s:.0f} per engine CPU-s), {w.preemptions:.0f} preemptions", flush=True)  # fmt: skip
    return w


Measure = Callable[[int, float, str], Window]  # (value, seconds, label) -> the value's window


@dataclass
class Sweep:
    """Every window measured at each max_num_seqs value, and what the sweep-best rule dropped from it."""

    # the short windows: the sweep's values in its order, then those added below it
    passes: dict[int, list[Window]] = field(default_factory=dict)
    confirmed: dict[int, Window] = field(default_factory=dict)  # the long confirming windows
    later: dict[int, list[Window]] = field(default_factory=dict)  # windows after the sweep's (rounds)
    below: list[int] = field(default_factory=list)  # added below the sweep when none of it stayed clean
    dropped: list[tuple[int, float, str]] = field(default_factory=list)  # (value, preemptions, where seen)

    def windows(self, value: int) -> list[Window]:
        confirmed = [self.confirmed[value]] if value in self.confirmed else []
        return [*self.passes.get(value, []), *confirmed, *self.later.get(value, [])]

    def clean(self, value: int) -> bool:
        return all(w.preemptions == 0 for w in self.windows(value))

    def best(self) -> int | None:
        """The best goodput over the passes among the values no window saw preempt; None if none is clean."""
        clean = [v for v in self.passes if self.clean(v)]
        return (
            max(clean, key=lambda v: statistics.fmean(w.goodput for w in self.passes[v])) if clean else None
        )

    def add_later(self, value: int, windows: Sequence[Window], where: str) -> None:
        """More windows of one value; a clean value they see preempt is dropped."""
        was_clean = self.clean(value)
        self.later.setdefault(value, []).extend(windows)
        shown = sum(w.preemptions for w in windows)
        if was_clean and shown > 0:
            self.dropped.append((value, shown, where))

    def rows(self) -> list[Window]:
        """Each value's passes as one row: the sweep's values in its order, then those added below it."""
        return [combined(windows) for windows in self.passes.values()]


def measure_sweep(values: Sequence[int], measure: Measure, seconds: float) -> Sweep:
    """Two passes over the values, rising then falling: one window of a few seconds can miss a value's rare
    preemption."""
    rising = {value: measure(value, seconds, "static") for value in values}
    falling = {value: measure(value, seconds, "static") for value in reversed(values)}
    return Sweep(passes={value: [rising[value], falling[value]] for value in values})


def confirmed_best(
    sweep: Sweep, measure: Measure, seconds: float, confirm_s: float, neighbours: bool = False
) -> int | None:
    """The sweep-best: the best clean value, confirmed clean over one `confirm_s` window (0: no confirming
    window), chosen again while the one chosen preempts there. With `neighbours`, the clean values either side of
    it are confirmed too (what the what-if benchmark judges its predictions on). When no value is clean, the
    sweep is extended below its lowest value, one value at a time (two `seconds` windows each, as the sweep), to 1
    if need be; None only when even 1 preempts."""
    while True:
        best = sweep.best()
        if best is None:
            lowest = min(sweep.passes)
            if lowest <= 1:
                return None
            below = lowest - 1
            print(
                f"no value down to {lowest} stayed clean: the sweep goes on below it, at {below}", flush=True
            )
            sweep.below.append(below)
            sweep.passes[below] = [measure(below, seconds, "below the sweep") for _ in range(2)]
            continue
        if confirm_s <= 0:
            return best
        values = sorted(sweep.passes)
        i = values.index(best)
        around = values[max(0, i - 1) : i + 2] if neighbours else [best]
        todo = [v for v in around if v not in sweep.confirmed and sweep.clean(v)]
        if not todo:
            return best
        for value in todo:
            window = measure(value, confirm_s, "confirm")
            sweep.confirmed[value] = window
            if window.preemptions > 0:
                print(f"max_num_seqs {value} preempted {window.preemptions:.0f} times in its {confirm_s:g} s "
                      "confirming window: no clean value", flush=True)  # fmt: skip
                sweep.dropped.append((value, window.preemptions, f"its {confirm_s:g} s confirming window"))
