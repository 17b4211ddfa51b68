"""Rung 3 with the prefix-defeat detector's series: the operator reads defeats and tokens lost per reason
(and capped requests per mode) from recorded scrapes, the flag names each reason with its share, the tokens
lost and the fix, and the doctor adds where the span lies from the server's /kvtune/prefix-report."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import pytest

from kvtune.cli import main
from kvtune.contract import metrics as m
from kvtune.operator.decide.diagnosis import Diagnosis, diagnose
from kvtune.operator.decide.ladder import cap_max_tokens, flag_prefix_defeat
from kvtune.operator.decide.policy import TuningPolicy
from kvtune.operator.decide.sample import EngineView, Sample, engine_view_from_sample
from kvtune.operator.decide.window import Window
from kvtune.operator.io.sources import EngineWithProxy, MetricsEndpoint
from tests.operator.helpers import (
    FIXTURES,
    fixture_text,
    kvtune_with_detector,
    metrics_answer,
    prometheus_vector,
    recorded,
    serve_bodies,
    serve_routes,
    synthetic,
    vllm_asking_long,
)

REPORT = (FIXTURES / "prefix_report_varying_head.json").read_text()
# Between the recorded t0 and t1: 40 requests, 2,372 prompt tokens; the detector saw 30 varying-head
# defeats (1,440 tokens lost) and 2 misaligned ones (64 tokens lost).
VARYING_HEAD = (
    "varying_head: 30 prompts (94% of defeats), 1,440 tokens lost (61% of prompt tokens): "
    "move the varying span (timestamp, request id, user name) after the shared prompt"
)
MISALIGNED = (
    "misaligned: 2 prompts (6% of defeats), 64 tokens lost (3% of prompt tokens): "
    "put the shared document before the variable-length preamble"
)


@pytest.fixture()
def vllm_url() -> Iterator[str]:
    yield from serve_bodies([vllm_asking_long("t0"), vllm_asking_long("t1")])


@pytest.fixture()
def proxy_url() -> Iterator[str]:
    yield from serve_bodies([fixture_text("proxy_defeats_t0.prom"), fixture_text("proxy_defeats_t1.prom")])


def read_twice(source: EngineWithProxy) -> list[Sample]:
    samples = [source.read(), source.read()]
    assert all(isinstance(s, Sample) for s in samples), samples
    return [replace(s, timestamp=1000.0 + 10 * i) for i, s in enumerate(samples) if isinstance(s, Sample)]


def test_engine_and_proxy_metrics_read_as_one_sample(vllm_url: str, proxy_url: str) -> None:
    samples = read_twice(EngineWithProxy(MetricsEndpoint(vllm_url), MetricsEndpoint(proxy_url)))
    d = diagnose(Window.of(samples), engine_view_from_sample(samples[-1]))
    assert d.preemptions == 49 and d.prompt_tokens == 2372  # the engine's own series
    assert d.prefix_defeats == (("misaligned", 2.0), ("varying_head", 30.0))  # the proxy's, moved only
    assert d.prefix_defeat_tokens == (("misaligned", 64.0), ("varying_head", 1440.0))
    assert d.capped_requests == (("clamp", 3.0), ("default", 3.0))
    # the proxy's own start time never reads as the engine's (a proxy restart is not an engine restart)
    assert all(m.PROCESS_START not in s.gauges for s in samples)


def test_a_proxy_that_is_down_leaves_the_engine_sample(vllm_url: str) -> None:
    source = EngineWithProxy(MetricsEndpoint(vllm_url), MetricsEndpoint("http://127.0.0.1:9", timeout=1))
    sample = source.read()
    assert isinstance(sample, Sample) and m.PREEMPTIONS in sample.counters
    assert not any(name.startswith(m.PREFIX_DEFEATS) for name in sample.counters)
    assert source.proxy_problem is not None and "unreachable" in source.proxy_problem


def defeated_window() -> tuple[Diagnosis, EngineView]:
    t0 = recorded("proxy_defeats_t0.prom", 1000.0)
    t1 = recorded("proxy_defeats_t1.prom", 1010.0)
    engine_t0, engine_t1 = (
        recorded(f"kvtune_preempting_{t}.prom", 1000.0 + 10 * i) for i, t in enumerate(("t0", "t1"))
    )
    samples = []
    for engine, proxy in ((engine_t0, t0), (engine_t1, t1)):
        assert isinstance(engine, Sample) and isinstance(proxy, Sample)
        samples.append(Sample(engine.timestamp, {**engine.gauges}, {**engine.counters, **proxy.counters},
                              engine.histograms, engine.cache_config))  # fmt: skip
    view = engine_view_from_sample(samples[-1])
    return diagnose(Window.of(samples), view), view


def test_the_flag_names_each_reason_share_tokens_and_fix() -> None:
    d, view = defeated_window()
    advice = flag_prefix_defeat(d, view, TuningPolicy())  # no shared prefix declared: the series suffice
    assert advice.applicable
    assert advice.recommended == "fix the prompt layout (varying_head, misaligned)"
    assert VARYING_HEAD in advice.evidence and MISALIGNED in advice.evidence
    assert advice.evidence.index("varying_head") < advice.evidence.index(
        "misaligned"
    )  # most tokens lost first


def test_clean_traffic_flags_nothing() -> None:
    """Every reason present at 0 and not moving: nothing is flagged, whatever the hit rate."""
    clean = [recorded("proxy_defeats_t0.prom", 1000.0 + 10 * i) for i in range(2)]
    engine = [recorded(f"kvtune_preempting_{t}.prom", 1000.0 + 10 * i) for i, t in enumerate(("t0", "t1"))]
    samples = [
        Sample(e.timestamp, e.gauges, {**e.counters, **c.counters}, e.histograms, e.cache_config)
        for e, c in zip(engine, clean, strict=True)
        if isinstance(e, Sample) and isinstance(c, Sample)
    ]
    d = diagnose(Window.of(samples), engine_view_from_sample(samples[-1]))
    assert d.prefix_defeats == () and d.prefix_defeat_tokens == ()
    advice = flag_prefix_defeat(d, engine_view_from_sample(samples[-1]), TuningPolicy())
    assert not advice.applicable and advice.evidence == "no shared prefix declared"


def test_shorter_than_block_fix_carries_the_prefix_and_block_lengths() -> None:
    before, after = synthetic(1000.0), synthetic(1010.0, generated=400.0)
    grown = {
        f"{m.PREFIX_DEFEATS}:shorter_than_block": 8.0,
        f"{m.PREFIX_DEFEAT_TOKENS}:shorter_than_block": 80.0,
    }
    zero = dict.fromkeys(grown, 0.0)
    window = Window.of([Sample(before.timestamp, before.gauges, {**before.counters, **zero}, before.histograms,
                               before.cache_config),
                        Sample(after.timestamp, after.gauges, {**after.counters, **grown}, after.histograms,
                               after.cache_config)])  # fmt: skip
    view = engine_view_from_sample(window.latest)
    advice = flag_prefix_defeat(diagnose(window, view), view, TuningPolicy())
    assert "shorter_than_block: 8 prompts (100% of defeats), 80 tokens lost (40% of prompt tokens)" in (
        advice.evidence
    )
    assert "the shared prefix is 10 tokens, under one block of 16: lengthen it or use a smaller block" in (
        advice.evidence
    )


def test_the_old_unlabelled_capped_counter_still_reads() -> None:
    line = 'kvtune:capped_requests_total{engine="0",model_name="tiny"} 0.0'
    t0 = recorded("kvtune_preempting_t0.prom", 1000.0)
    t1 = recorded("kvtune_preempting_t1.prom", 1010.0, {line: line.replace("0.0", "7.0")})
    assert isinstance(t0, Sample) and isinstance(t1, Sample)
    d = diagnose(Window.of([t0, t1]), engine_view_from_sample(t1))
    assert d.capped_requests == (("", 7.0),)
    assert (
        "requests the cap changed in the window: unlabelled 7"
        in cap_max_tokens(d, engine_view_from_sample(t1), TuningPolicy()).evidence
    )


def doctor(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["doctor", *args, "--window-seconds", "0.2", "--samples", "2"]) == 0
    return capsys.readouterr().out


@pytest.fixture()
def kvtune_serve_url() -> Iterator[str]:
    """kvtune serve with its detector: /metrics at t0 then t1, and /kvtune/prefix-report."""
    yield from serve_routes({
        "/metrics": [metrics_answer(kvtune_with_detector("t0")), metrics_answer(kvtune_with_detector("t1"))],
        "/kvtune/prefix-report": [(200, "application/json", REPORT)],
    })  # fmt: skip


def test_doctor_says_where_the_varying_span_lies(
    kvtune_serve_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = doctor(["--metrics-url", kvtune_serve_url], capsys)
    assert (
        "  varying_head: tokens 0-11 vary (a timestamp or id?), then 48 shared tokens; 40 requests, "
        "1,920 tokens lost: move the varying span (tokens 0-11) (timestamp, request id, user name) after the "
        "shared prompt"
    ) in out
    assert (
        "  misaligned: 32 shared tokens start at token 7, shifted 5 tokens against an earlier prompt (5 off the "
        "block grid); 3 requests, 96 tokens lost: put the shared document before the variable-length preamble "
        "(it moves by 5 tokens between prompts)"
    ) in out
    assert "flag_prefix_defeat: prefix hit rate: " in out and VARYING_HEAD in out


def test_doctor_json_carries_the_report(kvtune_serve_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(doctor(["--metrics-url", kvtune_serve_url + "/metrics", "--json"], capsys))
    prefix = report["prefix_report"]
    assert prefix["url"] == kvtune_serve_url + "/kvtune/prefix-report" and prefix["block_size"] == 16
    first = prefix["defeats"][0]
    assert (first["reason"], first["defeats"], first["tokens_lost"], first["in_window"]) == (
        "varying_head", 40, 1920, True,
    )  # fmt: skip
    assert first["where"] == "tokens 0-11 vary (a timestamp or id?), then 48 shared tokens"
    assert first["example"]["prompt_hash"] == "9f3a1c2e07d4b611" and "text" not in first["example"]
    assert [e["reason"] for e in prefix["defeats"]] == [
        "varying_head",
        "misaligned",
    ]  # reasons at 0: left out
    flag = report["remedies"][2]
    assert flag["applicable"] and flag["recommended"] == "fix the prompt layout (varying_head, misaligned)"


def test_doctor_on_vllm_without_a_report_says_nothing_of_it(capsys: pytest.CaptureFixture[str]) -> None:
    routes = {"/metrics": [metrics_answer(vllm_asking_long("t0")), metrics_answer(vllm_asking_long("t1"))]}
    for url in serve_routes(routes):  # /kvtune/prefix-report: 404, as on vLLM
        out = doctor(["--metrics-url", url], capsys)
        assert "Prefix-cache defeats" not in out and "flag_prefix_defeat: not applicable" in out
        report = json.loads(doctor(["--metrics-url", url, "--json"], capsys))
        assert report["prefix_report"] is None


def test_doctor_through_prometheus_names_the_reason_from_the_series(
    capsys: pytest.CaptureFixture[str],
) -> None:
    answers = [
        (200, "application/json", prometheus_vector(kvtune_with_detector(t), 1000.0 + 10 * i))
        for i, t in enumerate(("t0", "t1"))
    ]
    for url in serve_routes({"/api/v1/query": answers}):
        out = doctor(["--prometheus", url, "--selector", 'job="kvtune"'], capsys)
        assert VARYING_HEAD in out and MISALIGNED in out
        assert "Prefix-cache defeats" not in out  # no positions without a report


def test_doctor_after_the_incident_still_says_what_the_report_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Traffic has stopped: no counter moves in the window, yet the report's defeats since start are said."""
    after = metrics_answer(kvtune_with_detector("t1"))
    routes = {"/metrics": [after, after], "/kvtune/prefix-report": [(200, "application/json", REPORT)]}
    for url in serve_routes(routes):
        out = doctor(["--metrics-url", url], capsys)
        assert "Prefix-cache defeats before the window, none in it" in out
        assert "Prefix-cache defeats in the window" not in out
        assert "  varying_head: tokens 0-11 vary (a timestamp or id?)" in out


def test_doctor_on_vllm_with_a_proxy_reads_both_and_the_proxy_report(
    vllm_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtune doctor --metrics-url VLLM --proxy PROXY`: vLLM's preemptions and the proxy's defeats in one
    diagnosis, and the span positions from the proxy's prefix report (vLLM has none)."""
    proxy = {
        "/metrics": [
            metrics_answer(fixture_text("proxy_defeats_t0.prom")),
            metrics_answer(fixture_text("proxy_defeats_t1.prom")),
        ],
        "/kvtune/prefix-report": [(200, "application/json", REPORT)],
    }
    for proxy_url in serve_routes(proxy):
        report = json.loads(doctor(["--metrics-url", vllm_url, "--proxy", proxy_url, "--json"], capsys))
        assert report["findings"]["preemptions"] == 49
        assert report["prefix_report"]["url"] == proxy_url + "/kvtune/prefix-report"
        assert report["prefix_report"]["defeats"][0]["reason"] == "varying_head"
        flag = report["remedies"][2]
        assert flag["applicable"] and "varying_head" in flag["recommended"]


def test_doctor_proxy_flag_needs_the_engine_url(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "doctor",
        "--prometheus",
        "http://127.0.0.1:9",
        "--selector",
        "job=x",
        "--proxy",
        "http://127.0.0.1:9",
    ]
    assert main(argv) == 2
    assert "--proxy needs --metrics-url" in capsys.readouterr().err
