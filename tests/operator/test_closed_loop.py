"""The closed loop on a real engine: `kvtune serve` (tiny model, a 1,024-token pool, max_num_seqs 64) under
16 closed-loop clients preempts; the local-mode operator brings preemptions to zero (a 6 s stretch without
one) within a bounded number of intervals, every request completes, and at the end the preemption rate is
under a tenth of the untuned one (the tuner's upward probes may meet a rare preemption at a marginal value,
which its feedback then steps back from)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvtune.bench.engine_process import EngineProcess, start_engine, write_tiny_model
from kvtune.bench.load import BackgroundLoad, LoadShape
from kvtune.operator.actuators import KvtuneAdminActuator
from kvtune.operator.diagnosis import diagnose
from kvtune.operator.engine_view import engine_view_from_sample
from kvtune.operator.ladder import plan
from kvtune.operator.local import Tick, run_loop
from kvtune.operator.metric_names import PREEMPTIONS
from kvtune.operator.policy import Mode, TuningPolicy
from kvtune.operator.sample import Sample
from kvtune.operator.sources import MetricsEndpoint
from kvtune.operator.window import Window

TOKEN = "closed-loop-token"
INTERVAL = 0.5
POLICY = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=2.0, cooldown_s=2.0)
MAX_INTERVALS = 30  # preemption must have stopped within this many sampling intervals
QUIET_SECONDS = 6.0  # ... for at least this long


def first_quiet_stretch(counts: list[tuple[float, float]], seconds: float) -> float | None:
    """When the first stretch of `seconds` without a new preemption began (None if there was none)."""
    for i, (start, value) in enumerate(counts):
        for end, later in counts[i + 1 :]:
            if later != value:
                break
            if end - start >= seconds:
                return start
    return None


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    folder = tmp_path_factory.mktemp("closed_loop")
    token = folder / "token"
    token.write_text(TOKEN + "\n")
    model = write_tiny_model(folder / "tiny")
    live = start_engine(
        model, token, folder / "engine.log", "--kv-cache-tokens", "1024", "--max-num-seqs", "64"
    )
    yield live
    live.stop()


def read(source: MetricsEndpoint) -> Sample:
    sample = source.read()
    assert isinstance(sample, Sample), sample
    return sample


def test_operator_brings_preemptions_to_zero_without_losing_a_request(engine: EngineProcess) -> None:
    source = MetricsEndpoint(engine.url)
    actuator = KvtuneAdminActuator(engine.url, TOKEN)
    load = BackgroundLoad(engine.url, LoadShape(clients=16)).start()
    ticks: list[Tick] = []
    try:
        # the untuned engine preempts, and doctor says so on the live metrics
        before = read(source)
        time.sleep(3)
        after = read(source)
        d = diagnose(Window.of([before, after]), engine_view_from_sample(after))
        assert d.preempting, "the workload must preempt at max_num_seqs 64"
        lower = plan(d, engine_view_from_sample(after), POLICY)[1]
        assert lower.applicable and isinstance(lower.recommended, int) and lower.recommended < 64

        stop = threading.Event()
        loop = threading.Thread(
            target=run_loop, args=(source, actuator, POLICY, INTERVAL, stop, ticks.append)
        )
        began = time.time()
        loop.start()
        counts: list[tuple[float, float]] = []
        while time.time() - began < MAX_INTERVALS * INTERVAL + QUIET_SECONDS:
            sample = read(source)
            counts.append((sample.timestamp, sample.counters[PREEMPTIONS]))
            time.sleep(INTERVAL)
        stop.set()
        loop.join(10)
    finally:
        tally = load.stop()
    applied = [(change.knob, change.before, change.value) for t in ticks for change, ok in t.applied if ok.ok]
    assert applied and applied[0][0] == "max_num_seqs" and applied[0][2] < 64, applied
    final = actuator.current().values["max_num_seqs"]
    assert final is not None and final < 64
    quiet_at = first_quiet_stretch(counts, QUIET_SECONDS)
    assert quiet_at is not None and quiet_at - began <= MAX_INTERVALS * INTERVAL, (applied, counts)
    initial_rate = d.preemption_rate or 0.0
    final_rate = (counts[-1][1] - counts[-13][1]) / (counts[-1][0] - counts[-13][0])
    assert final_rate < 0.1 * initial_rate, (applied, final_rate, initial_rate)
    assert not tally.failures, tally.failures[:3]
    assert tally.completed == tally.sent > 0
