"""The demo's run: engine, load, operator, and the user's two moves, in the ladder's order.

The operator is `kvtune operator --local --mode Apply`'s loop (`run_loop`) in a thread, on the same
MetricsEndpoint and KvtuneAdminActuator. The demo itself only does what a user would: after the prefix flag
it moves the timestamp behind the shared prompt, and after the FP8 recommendation it restarts the engine
with `--kv-cache-dtype fp8` at the same bytes (the operator puts its desired values back by itself).
"""

from __future__ import annotations

import bisect
import contextlib
import secrets
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from kvtune.contract import metrics as m
from kvtune.contract.prefix_report import report_url
from kvtune.demo.engine import Engine, EngineSpec
from kvtune.demo.recorder import Recorder, RecordingSource
from kvtune.demo.timeline import Action, Figures, Point, Timeline, span_hit_rate
from kvtune.demo.view import LiveView
from kvtune.demo.workload import (
    ANSWER_TOKENS,
    DECLARED_MAX_TOKENS,
    SHARED_PROMPT_TOKENS,
    PromptLayout,
    load_shape,
    shared_prompt,
)
from kvtune.errors import KvtuneError
from kvtune.harness.load import BackgroundLoad, Failure, failure_cause
from kvtune.operator.decide.loop import run_loop
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.sample import NoData, Sample
from kvtune.operator.io.actuators import KvtuneAdminActuator
from kvtune.operator.io.prefix_report import defeat_entries, entry_line, fetch_report
from kvtune.operator.io.sources import MetricsEndpoint

KV_BYTES_PER_TOKEN_BF16 = 2 * 4 * 2 * 32 * 2  # K and V x 4 layers x 2 KV heads x head_dim 32 x 2 bytes


@dataclass(frozen=True)
class DemoPlan:
    clients: int
    kv_pool_tokens: int  # at bf16, the engine's dtype here; FP8 doubles it at the same bytes
    evaluation_s: float  # the operator's evaluation window and cooldown
    interval_s: float
    user_reads_s: float  # how long the user takes to act on the flag
    hit_rate_rise_s: float  # the workload after the move, before the FP8 restart
    settle_s: float  # after the restart: the "after" figures' window ("the last minute")
    # The "before" window, the engine in trouble observed before the operator may act: at least this many
    # evaluation windows and this many preemptions, whichever takes longer, so a fast CPU (which reaches
    # trouble sooner) shows as much of it as a slow one.
    before_windows: int
    before_preemptions: int
    ladder_timeout_s: float  # a rung that has not fired by then fails the demo (never faked)

    @property
    def kv_bytes(self) -> int:
        return self.kv_pool_tokens * KV_BYTES_PER_TOKEN_BF16


FULL = DemoPlan(clients=24, kv_pool_tokens=4096, evaluation_s=8, interval_s=1.0, user_reads_s=5,
                hit_rate_rise_s=15, settle_s=60, before_windows=3, before_preemptions=10,
                ladder_timeout_s=150)  # fmt: skip
QUICK = DemoPlan(clients=24, kv_pool_tokens=4096, evaluation_s=5, interval_s=1.0, user_reads_s=2,
                 hit_rate_rise_s=6, settle_s=15, before_windows=3, before_preemptions=10,
                 ladder_timeout_s=70)  # fmt: skip
START_MAX_NUM_SEQS = 256
HIT_RATE_GOAL = 0.8  # the goal for the prefix-cache hit rate once the timestamp has moved
MIN_FINISHED = 10  # finished requests before the operator starts: a generation-length distribution


class Demo:
    def __init__(self, plan: DemoPlan, port: int, out_dir: Path, view: LiveView, quick: bool) -> None:
        self.plan = plan
        self.port = port
        self.out_dir = out_dir
        self.view = view
        self.quick = quick
        self.started = time.time()
        self.stop_event = threading.Event()

    def now(self) -> float:
        return round(time.time() - self.started, 1)

    def run(self) -> Timeline:
        with tempfile.TemporaryDirectory(prefix="kvtune-demo-") as tmp, contextlib.ExitStack() as stack:
            token = secrets.token_hex(16)
            token_file = Path(tmp) / "admin-token"
            token_file.write_text(token)
            spec = EngineSpec(self.port, token_file, self.out_dir / "engine.log", self.plan.kv_bytes,
                              START_MAX_NUM_SEQS, "bfloat16", 1)  # fmt: skip
            self.view.message(f"starting kvtune serve --tiny on port {self.port} (log: {spec.log})")
            engines: list[Engine] = []
            stack.callback(_stop_all, engines)
            engines.append(self._boot(spec, "auto"))
            pool_auto = pool_tokens(engines[-1].url)
            layout = PromptLayout(shared_prompt())
            load = BackgroundLoad(engines[-1].url, load_shape(self.plan.clients, layout)).start()
            stack.callback(lambda: load.stop(30))
            stack.callback(_stop_all, engines)  # first: in-flight requests end
            observe_s = self.plan.before_windows * self.plan.evaluation_s
            self.view.message(f"the load is on; the operator may act once the engine has been seen in trouble for "
                              f"{observe_s:.0f} s and {self.plan.before_preemptions} preemptions")  # fmt: skip
            source = RecordingSource(MetricsEndpoint(engines[-1].url))
            recorder = Recorder(source, self.started, phase="0 in trouble")
            before_from, before_to = self._observe_trouble(source, recorder)
            recorder.enter("1 cap max_tokens")
            policy = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=self.plan.evaluation_s,
                                  cooldown_s=self.plan.evaluation_s, shared_prefix_tokens=SHARED_PROMPT_TOKENS, max_step=START_MAX_NUM_SEQS)  # fmt: skip
            actuator = KvtuneAdminActuator(engines[-1].url, token)
            operator = threading.Thread(
                target=run_loop, args=(source, actuator, policy, self.plan.interval_s, self.stop_event, recorder),
                daemon=True,
            )  # fmt: skip
            operator.start()
            stack.callback(operator.join, 30)
            stack.callback(self.stop_event.set)

            self._wait_for(recorder, lambda: _has(recorder, "cap_max_tokens", "applied"), "1 cap max_tokens")
            recorder.enter("2 lower max_num_seqs")
            self._wait_for(
                recorder, lambda: _has(recorder, "flag_prefix_defeat", "flagged"), "2 lower max_num_seqs"
            )
            recorder.enter("3 prefix defeat")
            self._sleep(recorder, self.plan.user_reads_s)
            hit_before = span_hit_rate(recorder.points[-5:])
            where = prefix_where(engines[-1].url)
            layout.move_timestamp()
            recorder.add_action(Action(self.now(), "flag_prefix_defeat", "user", "prompt layout",
                                       "timestamp at the head", "timestamp after the shared prompt",
                                       f"the user moved the timestamp after the {SHARED_PROMPT_TOKENS}-token shared "
                                       f"prompt (hit rate {_pct(hit_before)} before); flag: {where}"))  # fmt: skip
            self._sleep(recorder, self.plan.hit_rate_rise_s)
            # the requests already queued carry the old layout: the hit rate rises as the queue turns over,
            # and the user restarts the engine only once it has (or the picture credits FP8 with it)
            self._wait_until(recorder, lambda: (span_hit_rate(recorder.points[-5:]) or 0.0) >= HIT_RATE_GOAL,
                             self.plan.ladder_timeout_s)  # fmt: skip
            self._wait_for(
                recorder, lambda: _has(recorder, "recommend_fp8_kv", "recommended"), "3 prefix defeat"
            )
            recorder.enter("4 FP8 KV")
            running_before = _mean([p.running for p in recorder.points[-5:]])
            restarted_at = self.now()  # the user's action: before it, the operator's re-applied cap after it
            engines[-1].stop()
            engines.append(self._boot(spec, "fp8"))
            pool_fp8 = pool_tokens(engines[-1].url)
            recorder.add_action(Action(restarted_at, "recommend_fp8_kv", "user", "kv_cache_dtype", "auto", "fp8",
                                       f"the user restarted the engine with --kv-cache-dtype fp8 at the same "
                                       f"{self.plan.kv_bytes:,} bytes: KV pool {pool_auto:,} -> {pool_fp8:,} tokens"))  # fmt: skip
            self._sleep(recorder, self.plan.evaluation_s)
            # the operator re-sizes max_num_seqs for the doubled pool (it may preempt on the way there): the
            # "after" window starts once it has held still, preemption-free, for two evaluation windows
            self._wait_until(recorder, lambda: _quiet(recorder, self.now(), 2 * self.plan.evaluation_s),
                             self.plan.ladder_timeout_s)  # fmt: skip
            recorder.enter("settled")
            settle_from_t = recorder.points[-1].t
            self._sleep(recorder, self.plan.settle_s)
            running_after = _mean([p.running for p in recorder.points if p.t > settle_from_t])
            self.stop_event.set()
            operator.join(30)
            tally = load.stop(30)
            meta = {
                "kv_pool_tokens_auto": pool_auto, "kv_pool_tokens_fp8": pool_fp8, "kv_cache_bytes": self.plan.kv_bytes,
                "block_size": 16, "clients": self.plan.clients, "max_tokens_declared": DECLARED_MAX_TOKENS,
                "max_tokens_answered": list(ANSWER_TOKENS), "shared_prompt_tokens": SHARED_PROMPT_TOKENS,
                "quick": self.quick, "started_at": self.started, "duration_s": round(time.time() - self.started, 1),
                "running_mean_before_fp8": running_before, "running_mean_after_fp8": running_after,
                "requests_sent": tally.sent, "requests_completed": tally.completed,
                "requests_failed": len(tally.failures), "engine_pids": [engine.pid for engine in engines],
                "port": self.port,
            }  # fmt: skip
            points = list(recorder.points)
            before = figures("the engine in trouble, before the operator may act", points, tally.latencies,
                             self.started, before_from, before_to)  # fmt: skip
            after = figures("settled: the operator held still, preemption-free", points, tally.latencies,
                            self.started, settle_from_t, points[-1].t)  # fmt: skip
            failures = failures_by_phase(tally.failures, list(recorder.phases), self.started)
            return Timeline(points, list(recorder.actions), before, after, meta, failures)

    def _observe_trouble(self, source: RecordingSource, recorder: Recorder) -> tuple[float, float]:
        """The "before" window, in seconds since the start: the engine in trouble, watched before the operator
        may act. It opens at the sample before the first preemption and closes once it has lasted
        `before_windows` evaluation windows and counted `before_preemptions` preemptions, whichever is later,
        with the engine still preempting (the operator's first window must see it, or it reads a full pool
        without preemption and flags the prefix before the cap) and enough requests finished to size a cap."""
        deadline = time.monotonic() + self.plan.ladder_timeout_s
        observe_s = self.plan.before_windows * self.plan.evaluation_s
        previous: Sample | None = None
        opened: float | None = None
        counted, streak = 0.0, 0  # streak: samples in a row that saw a preemption (a burst, not a blip)
        while time.monotonic() < deadline:
            tick_started = time.monotonic()
            sample = source.read()
            if not isinstance(sample, NoData):
                recorder.observe(sample, START_MAX_NUM_SEQS, None)
                self._refresh(recorder)
                increase = counter_increase(previous, sample, m.PREEMPTIONS)
                if opened is None and increase > 0 and previous is not None:
                    opened = round(previous.timestamp - self.started, 2)
                counted += increase if opened is not None else 0.0
                streak = streak + 1 if increase > 0 else 0
                previous = sample
                finished = sample.histograms.get(m.REQUEST_GENERATION_TOKENS)
                now = round(sample.timestamp - self.started, 2)
                if (
                    opened is not None
                    and now - opened >= observe_s
                    and counted >= self.plan.before_preemptions
                    and streak >= 2
                    and finished
                    and finished.count >= MIN_FINISHED
                ):
                    return opened, now
            time.sleep(max(0.0, self.plan.interval_s - (time.monotonic() - tick_started)))
        raise KvtuneError(
            f"the engine was not seen in trouble ({self.plan.before_preemptions} preemptions over at least "
            f"{observe_s:.0f} s, still preempting) within {self.plan.ladder_timeout_s:.0f} s: no trouble to fix"
        )

    def _boot(self, spec: EngineSpec, kv_cache_dtype: str) -> Engine:
        engine = Engine(spec, kv_cache_dtype)
        with (self.out_dir / "children.txt").open("a") as pids:
            pids.write(f"{engine.pid}\n")
        return engine

    def _sleep(self, recorder: Recorder, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._refresh(recorder)
            time.sleep(0.5)

    def _refresh(self, recorder: Recorder) -> None:
        with recorder.lock:
            point = recorder.points[-1] if recorder.points else None
            actions = list(recorder.actions)
        self.view.update(point, actions)

    def _wait_until(self, recorder: Recorder, done: Callable[[], bool], seconds: float) -> None:
        """Until `done` or `seconds` pass; the demo goes on either way (the report shows what was reached)."""
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            self._refresh(recorder)
            time.sleep(0.5)

    def _wait_for(self, recorder: Recorder, done: Callable[[], bool], phase: str) -> None:
        deadline = time.monotonic() + self.plan.ladder_timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise KvtuneError(
                    f"the operator did not move past phase {phase!r} within {self.plan.ladder_timeout_s:.0f} s "
                    f"(the engine's log: {self.out_dir / 'engine.log'})"
                )
            self._refresh(recorder)
            time.sleep(0.5)


def _stop_all(engines: list[Engine]) -> None:
    for engine in engines:
        engine.stop()


def _has(recorder: Recorder, rung: str, kind: str) -> bool:
    with recorder.lock:
        return any(a.rung == rung and a.kind == kind for a in recorder.actions)


def _quiet(recorder: Recorder, now: float, seconds: float) -> bool:
    """No operator action and no preemption in the last `seconds`."""
    with recorder.lock:
        recent = [p for p in recorder.points if p.t >= now - seconds]
        acted = any(a.t >= now - seconds and a.kind != "user" for a in recorder.actions)
    covered = bool(recent) and recent[0].t <= now - seconds + 2
    return covered and not acted and all((p.preemptions_per_s or 0.0) == 0.0 for p in recent)


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 3) if present else None


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def pool_tokens(url: str) -> int:
    """The KV pool's size in tokens, as the engine's vllm:cache_config_info says."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            label = line.split('kv_cache_size_tokens="', 1)[1]
            return int(label.split('"', 1)[0])
    raise KvtuneError("the engine's /metrics has no vllm:cache_config_info")


def prefix_where(url: str) -> str:
    """Where the prefix report says the varying span sits (the flag's evidence names the reason only)."""
    report = fetch_report(report_url(url))
    entries = defeat_entries(report) if report else []
    return entry_line(entries[0]) if entries else "the engine's prefix report had no defeat to show"


def counter_increase(before: Sample | None, now: Sample, key: str) -> float:
    """A counter's increase between two samples of one engine; 0 for the first sample or a fall (restart)."""
    if before is None or key not in now.counters or key not in before.counters:
        return 0.0
    return max(0.0, now.counters[key] - before.counters[key])


def figures(window: str, points: list[Point], latencies: list[tuple[float, float]], started: float,
            t_from: float, t_to: float) -> Figures:  # fmt: skip
    """Measured over the points in (t_from, t_to], seconds since the start: the preemption counter's
    increase (and per minute of the window), mean throughput, the hit rate as the span's hit tokens over its
    looked-up tokens (a mean of per-second ratios would weigh a second with one short prompt like a busy
    one), p95 of the client-side latencies of the requests that finished in the window."""
    span = [p for p in points if t_from < p.t <= t_to]
    increases = [p.preemptions for p in span]
    counted = None if not span or None in increases else round(sum(i or 0.0 for i in increases), 1)
    window_s = round(t_to - t_from, 1)
    per_minute = None if counted is None or window_s <= 0 else round(counted / window_s * 60, 1)
    done = [s for at, s in latencies if t_from < at - started <= t_to]
    return Figures(
        window=window,
        t_from=t_from,
        t_to=t_to,
        window_s=window_s,
        preemptions=counted,
        preemptions_per_minute=per_minute,
        throughput=_mean([p.throughput for p in span]),
        p95_latency_s=round(float(np.percentile(done, 95)), 2) if done else None,
        hit_rate=span_hit_rate(span),
    )


def failures_by_phase(
    failures: list[Failure], phases: list[tuple[float, str]], started: float
) -> dict[str, dict[str, int]]:
    """phase -> cause -> failed requests: each failure falls in the phase under way when the client gave up
    (`phases`: (seconds since the start, phase) at each change; before the first, the first), phases in
    the run's order."""
    times = [t for t, _ in phases]
    tallied: dict[str, dict[str, int]] = {phase: {} for _, phase in phases}
    for failure in failures:
        index = max(0, bisect.bisect_right(times, failure.at - started) - 1)
        causes = tallied[phases[index][1]]
        cause = failure_cause(failure.error)
        causes[cause] = causes.get(cause, 0) + 1
    return {phase: causes for phase, causes in tallied.items() if causes}
