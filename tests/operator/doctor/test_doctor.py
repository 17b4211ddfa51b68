"""`kvtune doctor`: the --json contract and the text report, on recorded scrapes served over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvtune.cli import main
from tests.operator.helpers import fixture_text, serve_bodies

REMEDIES = ["cap_max_tokens", "lower_max_num_seqs", "flag_prefix_defeat", "recommend_fp8_kv"]


@pytest.fixture()
def scrapes() -> Iterator[str]:
    """/metrics answers the recorded t0 scrape first, then t1 (49 preemptions later)."""
    bodies = [fixture_text("kvtune_preempting_t0.prom"), fixture_text("kvtune_preempting_t1.prom")]
    yield from serve_bodies(bodies)


def test_json_contract(scrapes: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--metrics-url", scrapes, "--json", "--window-seconds", "0.2", "--samples", "2"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    findings = report["findings"]
    for key in ("preemption_rate", "kv_usage", "prefix_hit_rate", "real_concurrency_ceiling"):
        assert key in findings
    assert findings["preemption_rate"] > 0
    assert findings["real_concurrency_ceiling"] == 3
    assert [r["remedy"] for r in report["remedies"]] == REMEDIES
    for remedy in report["remedies"]:
        assert set(remedy) == {"remedy", "applicable", "current", "recommended", "evidence"}
        assert isinstance(remedy["applicable"], bool) and isinstance(remedy["evidence"], str)
    lower = report["remedies"][1]
    # Sized from the p95 of the residents' total footprint: mean 177 (59.3 + 118.1, exact from the
    # histograms' sums), p95 ~293: 4 x 177 + 2 x 116 fits 1,024 tokens, 5 x 177 + 2.24 x 116 does not. The
    # p95 ceiling (3, all residents at p95 at once) is a finding and the fallback when the sums are missing.
    assert (lower["applicable"], lower["current"], lower["recommended"]) == (True, 64, 4)
    assert findings["pooled_p95_concurrency"] == 4
    assert "p95 of 4 residents' total footprint ~ 4 x 177 (mean)" in lower["evidence"]


def test_text_report_has_concrete_numbers(scrapes: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--metrics-url", scrapes, "--window-seconds", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs: 64 → 4" in out
    assert "Real concurrency ceiling: 3" in out
    assert out.index("cap_max_tokens") < out.index("lower_max_num_seqs") < out.index("recommend_fp8_kv")


def test_unreachable_source_is_a_no_data_report(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--metrics-url", "http://127.0.0.1:9", "--json", "--window-seconds", "0"])
    assert code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "no_data"
    assert not any(r["applicable"] for r in report["remedies"])


def test_prometheus_needs_a_selector(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--prometheus", "http://127.0.0.1:9"]) == 2
    assert "--selector" in capsys.readouterr().err


def test_operator_without_local_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator"]) == 2
    assert "in-cluster" in capsys.readouterr().err


def test_two_samples_give_no_what_if_table_and_say_why(
    scrapes: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 28: the fit needs 3 scrapes over 5 s; two say so in the text and in --json."""
    assert main(["doctor", "--metrics-url", scrapes, "--window-seconds", "0.2", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "What-if: no table" in out and "2 scrapes in the window, at least 3 needed" in out
    main(["doctor", "--metrics-url", scrapes, "--json", "--window-seconds", "0.2", "--samples", "2"])
    what_if = json.loads(capsys.readouterr().out)["what_if"]
    assert "at least 3 needed" in what_if["insufficient"]
