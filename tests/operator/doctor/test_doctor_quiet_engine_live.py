"""`kvtune doctor --metrics-url` on a live `kvtune serve` (tiny model, a 1,024-token pool) that preempted
under a load which has ended: it says it reads the counters since boot and recommends the max_num_seqs a
window spanning the whole incident would have; before the load, the same engine is idle, nothing to do."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
import torch

from kvtune.cli import main
from kvtune.engine.model.tiny_model import write_tiny_model
from kvtune.harness.load import BatchSpec, run_batch
from kvtune.operator.decide.diagnosis import diagnose
from kvtune.operator.decide.ladder import lower_max_num_seqs
from kvtune.operator.decide.policy import TuningPolicy
from kvtune.operator.decide.sample import Sample, engine_view_from_sample
from kvtune.operator.decide.window import Window
from kvtune.operator.io.sources import MetricsEndpoint
from tests.server.live_server import LiveServer, start_server

# 16 requests at once, ~30-token prompts, 150-200 tokens out: far more than 8 residents fit in 1,024 tokens
INCIDENT = BatchSpec(num_requests=16, prompt_tokens=(20, 40), output_tokens=(150, 200), seed=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    live = start_server(
        write_tiny_model(tmp_path_factory.mktemp("tiny")),
        "--kv-cache-tokens", "1024", "--block-size", "16", "--max-num-seqs", "8",
    )  # fmt: skip
    yield live
    live.stop()
    torch.set_num_threads(threads)


def read(url: str) -> Sample:
    sample = MetricsEndpoint(url).read()
    assert isinstance(sample, Sample), sample
    return sample


def doctor(url: str, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["doctor", "--metrics-url", url, "--window-seconds", "0.5", *flags]) == 0
    return capsys.readouterr().out


def test_doctor_after_the_incident_on_a_live_engine(
    server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = json.loads(doctor(server.url, capsys, "--json"))
    assert (fresh["status"], fresh["basis"]) == ("idle", "window")
    assert not any(r["applicable"] for r in fresh["remedies"])

    before = read(server.url)
    result = asyncio.run(run_batch(server.url, "tiny", INCIDENT))
    assert result.failed == 0 and result.preemptions and result.preemptions > 0
    server.wait_idle()
    after = read(server.url)

    asked = time.time()
    data = json.loads(doctor(server.url, capsys, "--json"))
    answered = time.time()
    assert (data["status"], data["basis"]) == ("active", "since_boot")
    assert data["findings"]["preemptions"] == result.preemptions
    assert data["findings"]["notes"][0]["code"] == "QuietSinceBoot"
    # the span runs from this (test) process's start, which the in-thread server's process collector reports,
    # to the doctor's last sample, taken while it ran
    started = after.gauges["process_start_time"]
    assert asked - started <= data["since_boot_seconds"] <= answered - started
    # what a window spanning the whole incident (first reading before the load) would have recommended
    engine = engine_view_from_sample(after)
    watched = lower_max_num_seqs(diagnose(Window.of([before, after]), engine), engine, TuningPolicy(), False)
    lower = next(r for r in data["remedies"] if r["remedy"] == "lower_max_num_seqs")
    assert watched.applicable and watched.recommended is not None and watched.recommended < 8
    assert (lower["applicable"], lower["current"], lower["recommended"]) == (True, 8, watched.recommended)

    text = doctor(server.url, capsys)
    assert "the engine is quiet now; diagnosing from its counters since boot (" in text
    assert f"max_num_seqs: 8 → {watched.recommended}" in text
