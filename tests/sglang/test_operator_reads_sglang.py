"""The operator and the doctor on SGLang's recorded /metrics: its series land on kvtune's canonical names,
its retractions read as preemptions under KV pressure and the remedies follow; with a kvtune proxy in front,
the engine's and the proxy's scrapes read as one sample and a timestamp at the head of the prompts is
flagged as a prefix defeat."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtune.cli import main
from kvtune.contract import metrics as m
from kvtune.operator.decide.diagnosis import diagnose
from kvtune.operator.decide.ladder import flag_prefix_defeat
from kvtune.operator.decide.policy import TuningPolicy
from kvtune.operator.decide.sample import Sample, engine_view_from_sample
from kvtune.operator.decide.window import Window
from kvtune.operator.io.sources import EngineWithProxy, MetricsEndpoint
from tests.operator.helpers import parse_exposition
from tests.proxy.live_proxy import TENANT_HEADER, LiveProxy
from tests.proxy.prefix_chats import clean_chat, stamped_chat
from tests.sglang.stand_in import SGLangStandIn, metrics_scrapes

T0, T1 = metrics_scrapes()


def sglang_total(text: str, family: str) -> float:
    """The sum of one SGLang family's samples over all its label sets, read with Prometheus' own parser."""
    return sum(
        sample.value
        for parsed in text_string_to_metric_families(text)
        for sample in parsed.samples
        if sample.name == family
    )


def recorded(text: str, t: float) -> Sample:
    sample = parse_exposition(text, t, "sglang")
    assert isinstance(sample, Sample), sample
    return sample


def test_recorded_scrapes_land_on_canonical_names() -> None:
    for text, t in ((T0, 1000.0), (T1, 1010.0)):
        sample = recorded(text, t)
        for canonical, family in (
            (m.KV_USAGE, "sglang:token_usage"),
            (m.RUNNING, "sglang:num_running_reqs"),
            (m.WAITING, "sglang:num_queue_reqs"),
            (m.RETRACTED_NOW, "sglang:num_retracted_reqs"),
            (m.CACHE_HIT_RATE_GAUGE, "sglang:cache_hit_rate"),
        ):
            assert sample.gauges[canonical] == sglang_total(text, family), family
        for canonical, family in (
            (m.PREEMPTIONS, "sglang:num_retracted_requests_total"),
            (m.PROMPT_TOKENS, "sglang:prompt_tokens_total"),
            (m.PROMPT_TOKENS_CACHED, "sglang:cached_tokens_total"),
            (m.GENERATION_TOKENS, "sglang:generation_tokens_total"),
        ):
            # summed over SGLang's is_streaming / cache_source labels
            assert sample.counters[canonical] == sglang_total(text, family), family
    assert recorded(T1, 1010.0).counters[m.PREEMPTIONS] - recorded(T0, 1000.0).counters[m.PREEMPTIONS] == 20


def test_the_window_diagnoses_kv_pressure_and_retractions() -> None:
    t0, t1 = recorded(T0, 1000.0), recorded(T1, 1010.0)
    d = diagnose(Window.of([t0, t1]), engine_view_from_sample(t1))
    assert d.preemptions == 20 and d.preemption_rate == pytest.approx(2.0)
    assert d.kv_usage_max == pytest.approx(0.99) and d.saturated
    assert (d.running_max, d.waiting_max) == (15, 13)
    prompt = t1.counters[m.PROMPT_TOKENS] - t0.counters[m.PROMPT_TOKENS]
    cached = t1.counters[m.PROMPT_TOKENS_CACHED] - t0.counters[m.PROMPT_TOKENS_CACHED]
    assert d.prefix_hit_rate == pytest.approx(cached / prompt)  # from the counters, not the gauge


def doctor(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["doctor", *args, "--window-seconds", "0.2", "--samples", "2"]) == 0
    return capsys.readouterr().out


def test_doctor_names_retractions_as_preemptions_and_the_remedies(
    sglang: SGLangStandIn, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang exports no max_running_requests: the doctor is told it, as a user would."""
    out = doctor(["--metrics-url", sglang.url, "--max-num-seqs", "32"], capsys)
    assert "preemptions/s: prompts are paid for twice" in out
    assert "num_preemptions +20 over" in out and "KV usage max 99%" in out
    assert "KV cache 99% full while requests wait" in out
    assert "lower_max_num_seqs: max_num_seqs: 32 → " in out
    assert "recommend_fp8_kv: kv_cache_dtype: unset → fp8" in out


def test_doctor_json_on_sglang(sglang: SGLangStandIn, capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(doctor(["--metrics-url", sglang.url + "/metrics", "--json"], capsys))
    findings = report["findings"]
    assert (findings["preemptions"], findings["kv_usage_max"]) == (20, 0.99)
    assert (findings["requests_running"], findings["requests_waiting"]) == (14.5, 11)  # means of t0 and t1
    assert report["prefix_report"] is None  # SGLang has no /kvtune/prefix-report: nothing said of it
    remedies = {r["remedy"]: r for r in report["remedies"]}
    assert remedies["recommend_fp8_kv"]["applicable"]
    assert not remedies["flag_prefix_defeat"]["applicable"]  # SGLang alone cannot say why prefixes miss


def test_with_a_proxy_in_front_the_prefix_defeat_is_flagged(
    sglang: SGLangStandIn, proxy: LiveProxy, client: httpx.Client
) -> None:
    """The engine's scrape (t0, then t1) and the real proxy's, read as one sample before and after a run
    of chats whose system prompt starts with a timestamp."""
    source = EngineWithProxy(MetricsEndpoint(sglang.url), MetricsEndpoint(proxy.url))
    for i in range(4):  # clean traffic first: the detector must stay quiet on it
        assert client.post(
            "/v1/chat/completions", json=clean_chat(i), headers={TENANT_HEADER: "a"}
        ).is_success
    proxy.core.watch.drain()
    before = source.read()
    for i in range(8):
        response = client.post("/v1/chat/completions", json=stamped_chat(i), headers={TENANT_HEADER: "b"})
        assert response.status_code == 200
    proxy.core.watch.drain()
    after = source.read()
    assert isinstance(before, Sample) and isinstance(after, Sample) and source.proxy_problem is None
    samples = [replace(before, timestamp=1000.0), replace(after, timestamp=1010.0)]
    assert f"{m.PREFIX_DEFEATS}:varying_head" in before.counters  # present at 0 before the stamped run

    view = engine_view_from_sample(samples[-1])
    d = diagnose(Window.of(samples), view)
    assert d.preemptions == 20  # SGLang's retractions, from the engine's scrape
    defeats = dict(d.prefix_defeats)
    assert set(defeats) == {"varying_head"} and defeats["varying_head"] >= 6
    advice = flag_prefix_defeat(d, view, TuningPolicy())
    assert advice.applicable and advice.recommended == "fix the prompt layout (varying_head)"
    assert "move the varying span (timestamp, request id, user name) after the shared prompt" in (
        advice.evidence
    )


def test_the_pool_and_page_size_are_read_from_sglang() -> None:
    view = engine_view_from_sample(recorded(T1, 1010.0))
    assert (view.pool_tokens, view.block_size, view.max_model_len) == (8192, 16, 4096)


def test_the_generation_lengths_are_read_from_sglang() -> None:
    sample = recorded(T1, 1010.0)
    assert m.REQUEST_GENERATION_TOKENS in sample.histograms and m.REQUEST_PROMPT_TOKENS in sample.histograms
