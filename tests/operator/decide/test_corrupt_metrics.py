"""Impossible metric values (NaN, infinities, negative counters, a ratio outside [0, 1], buckets that fall
as `le` rises) are dropped from the sample and reported as a CorruptMetrics finding naming the series; the
doctor never prints them as figures and the operator loop never acts on them. The operator says so as the
doctor does: in its log (a figure it could not read is `unknown`, never 0), its status (conditions, note,
an Event) and its own metrics. A bad URL is one clear line."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvtune.cli import main
from kvtune.contract import metrics as m
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.diagnosis import diagnose
from kvtune.operator.decide.loop import step
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.ports import ActuatorResult
from kvtune.operator.decide.sample import NoData, Sample, SampleResult, engine_view_from_sample
from kvtune.operator.decide.tuner import TunerState
from kvtune.operator.decide.window import Window
from kvtune.operator.io.local_metrics import LocalRecorder
from kvtune.operator.io.own_metrics import OperatorMetrics
from tests.operator.helpers import (
    fixture_text,
    metrics_answer,
    parse_exposition,
    parse_series,
    recorded,
    series_names,
    serve_bodies,
    serve_routes,
)

KV_LINE = 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0'
RUNNING_LINE = 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0'
PREEMPTIONS_LINE = 'vllm:num_preemptions_total{engine="0",model_name="tiny"} 95.0'
BUCKET_LINE = 'vllm:request_generation_tokens_bucket{engine="0",le="500.0",model_name="tiny"} 80.0'

CASES = [
    pytest.param(PREEMPTIONS_LINE, "NaN", m.PREEMPTIONS, "vllm:num_preemptions_total", "NaN", id="nan-counter"),
    pytest.param(PREEMPTIONS_LINE, "+Inf", m.PREEMPTIONS, "vllm:num_preemptions_total", "+Inf", id="inf-counter"),
    pytest.param(PREEMPTIONS_LINE, "-3", m.PREEMPTIONS, "vllm:num_preemptions_total", "negative", id="negative"),
    pytest.param(RUNNING_LINE, "+Inf", m.RUNNING, "vllm:num_requests_running", "+Inf", id="inf-gauge"),
    pytest.param(RUNNING_LINE, "-Inf", m.RUNNING, "vllm:num_requests_running", "-Inf", id="minus-inf-gauge"),
    pytest.param(KV_LINE, "1.7", m.KV_USAGE, "vllm:kv_cache_usage_perc", "outside [0, 1]", id="kv-above-1"),
    pytest.param(KV_LINE, "-0.2", m.KV_USAGE, "vllm:kv_cache_usage_perc", "negative", id="kv-below-0"),
    pytest.param(
        BUCKET_LINE, "12", m.REQUEST_GENERATION_TOKENS, "vllm:request_generation_tokens_bucket",
        "bucket le=500 holds 12, less than le=200 (80)", id="falling-buckets",
    ),
]  # fmt: skip


def with_value(line: str, value: str) -> dict[str, str]:
    """The transform that gives the fixture's `line` another value."""
    assert line in fixture_text("kvtune_preempting_t1.prom")
    return {line: line.rsplit(" ", 1)[0] + " " + value}


def numbers(node: object) -> Iterator[float]:
    """Every number in a JSON document."""
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            yield from numbers(item)
    elif isinstance(node, float | int) and not isinstance(node, bool):
        yield float(node)


def kind_of(sample: Sample, key: str) -> bool:
    return key in sample.gauges or key in sample.counters or key in sample.histograms


@pytest.mark.parametrize(("line", "value", "key", "series", "problem"), CASES)
def test_an_impossible_value_is_dropped_and_named(
    line: str, value: str, key: str, series: str, problem: str
) -> None:
    clean = recorded("kvtune_preempting_t1.prom", 10.0)
    sample = recorded("kvtune_preempting_t1.prom", 10.0, with_value(line, value))
    assert isinstance(clean, Sample) and isinstance(sample, Sample)
    assert kind_of(clean, key) and not kind_of(sample, key)
    assert [name for name, _ in sample.corrupt] == [series]
    assert problem in sample.corrupt[0][1]
    # every other figure is kept as it was
    assert {k: v for k, v in clean.counters.items() if k != key} == dict(sample.counters)
    assert all(math.isfinite(v) for v in (*sample.gauges.values(), *sample.counters.values()))


@pytest.mark.parametrize(("line", "value", "key", "series", "problem"), CASES)
def test_diagnosis_reports_corrupt_metrics_and_never_uses_them(
    line: str, value: str, key: str, series: str, problem: str
) -> None:
    before = recorded("kvtune_preempting_t0.prom", 0.0)
    after = recorded("kvtune_preempting_t1.prom", 10.0, with_value(line, value))
    assert isinstance(before, Sample) and isinstance(after, Sample)
    d = diagnose(Window.of([before, after]), engine_view_from_sample(after))
    corrupt = [f for f in d.findings if f.code == "CorruptMetrics"]
    assert len(corrupt) == 1 and series in corrupt[0].message and problem in corrupt[0].evidence
    figures = [d.preemption_rate, d.kv_usage_max, d.kv_usage_mean, d.running_max, d.running_mean, d.goodput]
    assert all(f is None or (math.isfinite(f) and f >= 0) for f in figures), figures
    assert d.kv_usage_max is None or d.kv_usage_max <= 1
    if key == m.PREEMPTIONS:
        assert d.preemption_rate is None and d.restarts == 0  # neither a rate nor a "reset" from it


def test_a_scrape_with_nothing_usable_is_no_data_that_says_why() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_preemptions_total counter",
            'vllm:num_preemptions_total{model_name="x"} NaN',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{model_name="x"} +Inf',
            "",
        ]
    )
    result = parse_exposition(text, 1.0, "test")
    assert isinstance(result, NoData)
    assert "corrupt metrics" in result.reason and "vllm:num_preemptions_total: NaN" in result.reason


@pytest.fixture()
def corrupt_scrapes() -> Iterator[str]:
    """t0, then t1 with +Inf running requests and a NaN preemption counter."""
    t1 = fixture_text("kvtune_preempting_t1.prom")
    for old, new in (*with_value(RUNNING_LINE, "+Inf").items(), *with_value(PREEMPTIONS_LINE, "NaN").items()):
        t1 = t1.replace(old, new)
    yield from serve_bodies([fixture_text("kvtune_preempting_t0.prom"), t1])


def test_doctor_reports_corrupt_series_and_no_infinite_figure(
    corrupt_scrapes: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["doctor", "--metrics-url", corrupt_scrapes, "--json", "--window-seconds", "0.2"]
    main(args)
    report = json.loads(capsys.readouterr().out)
    assert all(math.isfinite(v) for v in numbers(report)), report["findings"]
    notes = [n for n in report["findings"]["notes"] if n["code"] == "CorruptMetrics"]
    assert len(notes) == 1
    assert "vllm:num_requests_running" in notes[0]["message"]
    assert "vllm:num_preemptions_total" in notes[0]["message"]
    assert report["findings"]["preemption_rate"] is None
    assert not any(r["applicable"] for r in report["remedies"] if r["remedy"] == "lower_max_num_seqs")


class Replay:
    """A metric source that answers recorded results in order."""

    def __init__(self, results: list[SampleResult]) -> None:
        self.results = results

    def read(self) -> SampleResult:
        return self.results.pop(0)


class RecordingActuator:
    knobs = frozenset({KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP})

    def __init__(self) -> None:
        self.applied: list[tuple[str, int | str | None]] = []

    def current(self) -> ActuatorResult:
        return ActuatorResult(True, {KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: None})

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        self.applied.append((knob, value))
        return ActuatorResult(True, {KNOB_MAX_NUM_SEQS: 64, KNOB_MAX_TOKENS_CAP: None, knob: value})


def run_two_ticks(transform: dict[str, str]) -> RecordingActuator:
    source = Replay(
        [recorded("kvtune_preempting_t0.prom", 0.0), recorded("kvtune_preempting_t1.prom", 10.0, transform)]
    )
    actuator = RecordingActuator()
    policy = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=5.0, cooldown_s=5.0)
    state, samples = TunerState(), deque[Sample]()
    for now in (0.0, 10.0):
        state = step(source, actuator, policy, state, samples, now).state
    return actuator


def test_the_operator_loop_never_acts_on_corrupt_figures() -> None:
    assert run_two_ticks({}).applied, "the clean recording preempts and the loop acts on it"
    assert run_two_ticks(with_value(PREEMPTIONS_LINE, "NaN")).applied == []
    assert run_two_ticks(with_value(PREEMPTIONS_LINE, "-95")).applied == []


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["doctor", "--metrics-url", "http://[::1"], "--metrics-url"),
        (["doctor", "--metrics-url", "localhost:8000"], "--metrics-url"),
        (["doctor", "--metrics-url", "http://"], "--metrics-url"),
        (["doctor", "--prometheus", "ftp://prom", "--selector", "job=x"], "--prometheus"),
        (["operator", "--local", "--target", "http://[::1", "--admin-token-file", "/dev/null"], "--target"),
    ],
)
def test_a_bad_url_is_one_clear_line(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"kvtune: error: {flag}: ")
    assert "Traceback" not in captured.err


def test_a_bad_url_from_the_shell_exits_non_zero_without_a_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "doctor", "--metrics-url", "http://[::1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        == "kvtune: error: --metrics-url: 'http://[::1' is not a valid URL: Invalid port: ':1'"
    )


# ---- the operator says what is corrupt, as the doctor does --------------------------------------------------

NAN_KV_NEGATIVE_COUNTER = {**with_value(KV_LINE, "NaN"), **with_value(PREEMPTIONS_LINE, "-3")}
CORRUPT_NAMES = ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total")


def test_the_local_operator_logs_unknown_and_names_the_corrupt_series(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The issue's note: with NaN usage and a negative counter the operator took no action (right), but
    its log said `KV usage max 0%` and never named the corrupt series."""
    corrupt = [recorded_text("kvtune_preempting_t0.prom", NAN_KV_NEGATIVE_COUNTER),
               recorded_text("kvtune_preempting_t1.prom", NAN_KV_NEGATIVE_COUNTER)]  # fmt: skip
    admin = (200, "application/json", '{"max_num_seqs": 64, "max_tokens_cap": null, "cap_mode": "clamp"}')
    for base in serve_routes({"/metrics": [metrics_answer(t) for t in corrupt], "/admin/config": [admin]}):
        token = tmp_path / "token"
        token.write_text("t")
        args = ["operator", "--local", "--target", base, "--admin-token-file", str(token), "--interval", "0.2",
                "--duration", "1.0", "--metrics-port", "0"]  # fmt: skip
        caplog.set_level(logging.INFO, logger="kvtune.operator")
        assert main(args) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtune.operator"]
    ticks = [line for line in lines if "KV usage max" in line]
    assert ticks and all("KV usage max unknown" in line for line in ticks), ticks
    assert not any("KV usage max 0%" in line for line in lines)
    named = [line for line in lines if line.startswith("corrupt metrics")]
    assert named and all(name in named[-1] for name in CORRUPT_NAMES), lines
    assert "NaN" in named[-1] and "negative (-3)" in named[-1]


def recorded_text(name: str, transform: dict[str, str]) -> str:
    text = fixture_text(name)
    for old, new in transform.items():
        text = text.replace(old, new)
    return text


def test_status_conditions_and_own_metrics_name_the_corrupt_series() -> None:
    t0 = recorded("kvtune_preempting_t0.prom", 0.0, NAN_KV_NEGATIVE_COUNTER)
    t1 = recorded("kvtune_preempting_t1.prom", 10.0, NAN_KV_NEGATIVE_COUNTER)
    policy = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=5.0, cooldown_s=5.0)
    source, actuator = Replay([t0, t1, recorded("kvtune_preempting_t1.prom", 20.0)]), RecordingActuator()
    recorder = LocalRecorder(OperatorMetrics(), "http://engine:8000", policy)
    state, samples, ticks = TunerState(), deque[Sample](), []
    for now in (0.0, 10.0):
        ticks.append(step(source, actuator, policy, state, samples, now))
        recorder(ticks[-1])
        state = ticks[-1].state
    conditions = {c.type: c for c in recorder.memory.conditions.values()}
    assert (
        conditions["KVSaturated"].status == "Unknown" and conditions["KVSaturated"].reason == "CorruptMetrics"
    )
    assert "KV usage max unknown" in conditions["KVSaturated"].message
    assert all(name in conditions["KVSaturated"].message for name in CORRUPT_NAMES)
    assert (
        conditions["Preempting"].status == "Unknown" and conditions["Preempting"].reason == "CorruptMetrics"
    )
    series = parse_series(generate_latest(recorder.metrics.registry).decode())
    labels = {"namespace": "local", "policy": "engine:8000"}
    for name in CORRUPT_NAMES:
        assert series[("kvtune_operator_corrupt_series", frozenset({**labels, "series": name}.items()))] == 1
    # the series comes clean: its corrupt series go, the figures are known again
    samples.clear()
    recorder(step(source, actuator, policy, TunerState(), samples, 20.0))
    series = parse_series(generate_latest(recorder.metrics.registry).decode())
    assert "kvtune_operator_corrupt_series" not in series_names(series)
    conditions = {c.type: c for c in recorder.memory.conditions.values()}
    assert (
        conditions["KVSaturated"].reason != "CorruptMetrics"
        and "unknown" not in conditions["KVSaturated"].message
    )
