"""Newer vLLM's preemption detail, read by the diagnosis, the ladder and the status conditions.

Three engines, from one recorded vLLM 0.32.0 scrape pair (29 preemptions of 16 requests, fixtures
vllm_0_32_preempting_t*.prom): as recorded (the per-request histogram `vllm:request_num_preemptions`); with
that family removed (what vLLM 0.29 and older expose: they must be read exactly as before); and with the
by-reason counter vllm#58037 proposes added (no release has it, so those lines are written here, in the
PR's shape). The spread over requests is checked as a property too, for any requests' counts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.cli import main
from kvtune.contract import metrics as m
from kvtune.contract.preemptions import REQUEST_PREEMPTIONS_BUCKETS
from kvtune.operator.decide.diagnosis import (
    Diagnosis,
    diagnose,
    kv_pressure_increase,
    preempted_requests,
    preemption_causes,
)
from kvtune.operator.decide.ladder import Remedy, plan
from kvtune.operator.decide.policy import TuningPolicy
from kvtune.operator.decide.sample import EngineView, Histogram, Sample, engine_view_from_sample
from kvtune.operator.decide.status import conditions_for
from kvtune.operator.decide.window import Window
from tests.operator.helpers import fixture_text, parse_exposition, serve_bodies

SPAN = 60.0
KNOWN = EngineView(max_num_seqs=32)  # vLLM's metrics do not carry max_num_seqs: the recording's flag
BY_REASON = "vllm:num_preemptions_by_reason_total"
Transform = Callable[[str, int], str]  # (scrape text, 0 for t0 or 1 for t1) -> text


def without_histogram(text: str) -> str:
    """The scrape as a vLLM older than 0.30 exposes it: no `vllm:request_num_preemptions` family."""
    return "\n".join(line for line in text.splitlines() if "vllm:request_num_preemptions" not in line) + "\n"


def with_reasons(text: str, reasons: dict[str, int]) -> str:
    """The scrape with vllm#58037's counter added: one series per reason, in the PR's labels."""
    lines = [f"# HELP {BY_REASON.removesuffix('_total')} Cumulative preemptions by reason.",
             f"# TYPE {BY_REASON.removesuffix('_total')} counter"]  # fmt: skip
    lines += [f'{BY_REASON}{{engine="0",model_name="tiny",reason="{r}"}} {n}.0' for r, n in reasons.items()]
    return text + "\n".join(lines) + "\n"


def window_of(t0: str, t1: str) -> Window:
    samples = [parse_exposition(t0, 0.0, "vllm"), parse_exposition(t1, SPAN, "vllm")]
    assert all(isinstance(s, Sample) for s in samples)
    return Window.of(s for s in samples if isinstance(s, Sample))


def as_recorded(text: str, _: int) -> str:
    return text


def scrapes(transform: Transform) -> list[str]:
    return [transform(fixture_text(f"vllm_0_32_preempting_t{i}.prom"), i) for i in (0, 1)]


def recorded(transform: Transform = as_recorded) -> tuple[Diagnosis, EngineView]:
    window = window_of(*scrapes(transform))
    engine = engine_view_from_sample(window.latest, KNOWN)
    return diagnose(window, engine), engine


def finding(d: Diagnosis, code: str) -> str:
    (found,) = [f for f in d.findings if f.code == code]
    return f"{found.message} | {found.evidence}"


# --- vLLM 0.30+: the histogram -------------------------------------------------------------------------
def test_the_recorded_histogram_tells_requests_preempted_more_than_once() -> None:
    d, _ = recorded()
    spread = d.preempted_requests
    assert spread is not None
    # 16 finished: 5 at most once, 7 twice, 4 three times; 29 preemptions, so 29 - 14 - 12 = 3 once
    assert (spread.finished, spread.preemptions, spread.more_than_once) == (16, 29, 11)
    assert (spread.preempted, spread.beyond, spread.beyond_bound) == (14, 0, 5)
    assert d.preemptions == 29 and d.other_preemptions is None and d.preemptions_by_reason == ()
    evidence = finding(d, "Preempting")
    assert "num_preemptions +29" in evidence
    assert "of 16 requests finished, 11 were preempted more than once, 14 at least once" in evidence


# --- vLLM before 0.30: neither series ---------------------------------------------------------------------
def test_an_older_vllm_is_read_as_before_and_decided_the_same() -> None:
    old, engine = recorded(lambda text, _: without_histogram(text))
    new, _ = recorded()
    assert (
        old.preempted_requests is None and old.preemptions_by_reason == () and old.other_preemptions is None
    )
    assert "request_num_preemptions" not in finding(old, "Preempting")
    # the histogram only adds evidence: every figure and every rung is the same without it
    assert old.preemptions == new.preemptions == 29 and old.preemption_rate == new.preemption_rate
    assert [f.code for f in old.findings] == [f.code for f in new.findings]
    policy = TuningPolicy()
    before = [(a.remedy, a.applicable, a.recommended) for a in plan(old, engine, policy)]
    assert before == [(a.remedy, a.applicable, a.recommended) for a in plan(new, engine, policy)]
    assert (Remedy.LOWER_MAX_NUM_SEQS, True) in [(a.remedy, a.applicable) for a in plan(old, engine, policy)]


# --- the by-reason counter (vllm#58037, as proposed) -------------------------------------------------------
def test_by_reason_only_kv_pressure_drives_the_ladder() -> None:
    reasons = ({"kv_full": 0, "priority": 0, "prefix_cache_reset": 0},
               {"kv_full": 15, "priority": 5, "prefix_cache_reset": 9})  # fmt: skip
    d, engine = recorded(lambda text, i: with_reasons(text, reasons[i]))
    assert d.preemptions == 20  # kv_full and priority: both evict because no block was free
    assert d.preemption_rate == 20 / SPAN and d.other_preemptions == 9
    assert d.preemptions_by_reason == (("kv_full", 15), ("prefix_cache_reset", 9), ("priority", 5))
    assert "for lack of KV blocks" in finding(d, "Preempting")
    other = finding(d, "PreemptedForOtherReasons")
    assert "9 preemptions not caused by a full KV cache" in other and "prefix_cache_reset 9" in other
    lower = next(a for a in plan(d, engine, TuningPolicy()) if a.remedy is Remedy.LOWER_MAX_NUM_SEQS)
    assert lower.applicable and "0.33/s" in lower.evidence


def test_preemptions_for_other_reasons_alone_are_reported_not_remedied() -> None:
    reasons = ({"kv_full": 0, "prefix_cache_reset": 0}, {"kv_full": 0, "prefix_cache_reset": 29})
    d, engine = recorded(lambda text, i: with_reasons(text, reasons[i]))
    assert d.preemptions == 0 and not d.preempting and d.other_preemptions == 29
    assert "Preempting" not in [f.code for f in d.findings]
    assert "prefix_cache_reset 29" in finding(d, "PreemptedForOtherReasons")
    assert not any(
        a.applicable for a in plan(d, engine, TuningPolicy()) if a.remedy is Remedy.LOWER_MAX_NUM_SEQS
    )
    (preempting,) = [
        c for c in conditions_for({}, d, None, (False, ""), (False, ""), SPAN) if c.type == "Preempting"
    ]
    assert (preempting.status, preempting.reason) == ("False", "NoKVPressurePreemptions")
    assert "29 for other reasons (prefix_cache_reset 29)" in preempting.message


def test_an_unknown_reason_counts_as_kv_pressure_and_is_named() -> None:
    reasons = ({"kv_full": 0, "swap_out": 0}, {"kv_full": 20, "swap_out": 9})
    d, _ = recorded(lambda text, i: with_reasons(text, reasons[i]))
    assert d.preemptions == 29 and d.other_preemptions == 0
    assert "not known to kvtune, counted as KV pressure: swap_out" in finding(d, "Preempting")


def test_the_tuner_counts_only_kv_pressure() -> None:
    def sample(t: float, total: float, reset: float) -> Sample:
        counters = {m.PREEMPTIONS: total, f"{m.PREEMPTIONS_BY_REASON}:prefix_cache_reset": reset,
                    f"{m.PREEMPTIONS_BY_REASON}:kv_full": total - reset}  # fmt: skip
        return Sample(timestamp=t, counters=counters)

    assert kv_pressure_increase(Window.of([sample(0, 3, 1), sample(10, 9, 7)])) == 0
    assert kv_pressure_increase(Window.of([sample(0, 3, 1), sample(10, 9, 2)])) == 5
    old = Window.of(
        [Sample(timestamp=0, counters={m.PREEMPTIONS: 3}), Sample(10, counters={m.PREEMPTIONS: 9})]
    )
    assert kv_pressure_increase(old) == 6 and preemption_causes(old) is None


# --- the spread, for any requests ---------------------------------------------------------------------------
def observed(counts: list[int], bounds: tuple[float, ...]) -> Histogram:
    """Each request's preemption count observed into cumulative buckets, as prometheus-client does."""
    buckets = tuple((b, float(sum(1 for n in counts if n <= b))) for b in (*bounds, float("inf")))
    return Histogram(buckets, float(len(counts)), float(sum(counts)))


@given(st.lists(st.integers(min_value=0, max_value=30), max_size=60))
def test_the_spread_matches_the_requests_in_vllms_buckets(counts: list[int]) -> None:
    spread = preempted_requests(observed(counts, REQUEST_PREEMPTIONS_BUCKETS))
    assert spread is not None
    assert spread.finished == len(counts) and spread.preemptions == sum(counts)
    assert spread.more_than_once == sum(1 for n in counts if n >= 2)
    assert spread.beyond == sum(1 for n in counts if n > 5) and spread.beyond_bound == 5
    # the first bucket holds 0 and 1: "at least once" is known from the sum while nothing went past 5
    expected = sum(1 for n in counts if n >= 1) if all(n <= 5 for n in counts) else None
    assert spread.preempted == expected


@given(st.lists(st.integers(min_value=0, max_value=30), max_size=60))
def test_a_bucket_at_zero_makes_at_least_once_exact(counts: list[int]) -> None:
    spread = preempted_requests(observed(counts, (0, 1, 2, 5, 10)))
    assert spread is not None
    assert spread.preempted == sum(1 for n in counts if n >= 1)
    assert spread.more_than_once == sum(1 for n in counts if n >= 2) and spread.beyond_bound == 2


def test_buckets_without_a_bound_at_one_say_nothing() -> None:
    assert preempted_requests(observed([0, 3, 7], (2, 5, 10))) is None


def test_an_exposition_spelled_with_underscores_reads_the_same() -> None:
    text = fixture_text("vllm_0_32_preempting_t1.prom")
    colon = parse_exposition(text, 1.0, "vllm")
    underscore = parse_exposition(re.sub(r"\bvllm:", "vllm_", text), 1.0, "vllm")
    assert isinstance(colon, Sample) and isinstance(underscore, Sample)
    assert colon.histograms[m.REQUEST_PREEMPTIONS] == underscore.histograms[m.REQUEST_PREEMPTIONS]


# --- the doctor: the same three engines over HTTP ------------------------------------------------------------
RESET = ({"kv_full": 0, "prefix_cache_reset": 0}, {"kv_full": 20, "prefix_cache_reset": 9})


def doctor(transform: Transform, *extra: str, capsys: pytest.CaptureFixture[str]) -> str:
    """`kvtune doctor` over two scrapes, t0 then t1, of one engine's /metrics: what it prints."""
    for url in serve_bodies(scrapes(transform)):
        argv = ["doctor", "--metrics-url", url, "--window-seconds", "0.2", "--samples", "2",
                "--max-num-seqs", "32"]  # fmt: skip
        assert main([*argv, *extra]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("transform", "by_reason", "spread"),
    [
        (lambda text, _: without_histogram(text), {}, None),
        (as_recorded, {}, (16, 29, 11, 14)),
        (
            lambda text, i: with_reasons(text, RESET[i]),
            {"kv_full": 20, "prefix_cache_reset": 9},
            (16, 29, 11, 14),
        ),
    ],
    ids=["vllm-before-0.30", "vllm-0.32-histogram", "by-reason-as-proposed"],
)
def test_the_doctor_reports_the_detail_each_engine_gives(
    transform: Transform,
    by_reason: dict[str, float],
    spread: tuple[float, ...] | None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    findings = json.loads(doctor(transform, "--json", capsys=capsys))["findings"]
    text = doctor(transform, capsys=capsys)
    assert findings["preemptions_by_reason"] == by_reason
    assert findings["preemptions"] == 29 - by_reason.get("prefix_cache_reset", 0)
    assert findings["other_preemptions"] == (by_reason.get("prefix_cache_reset") if by_reason else None)
    found = findings["preempted_requests"]
    if spread is None:
        assert found is None and "preempted more than once" not in text
    else:
        figures = ("finished", "preemptions", "more_than_once", "preempted")
        assert tuple(found[name] for name in figures) == spread
        assert "11 were preempted more than once, 14 at least once" in text
    assert ("not caused by a full KV cache" in text) is bool(by_reason)
