"""`kvtune doctor` on vLLM names the admission flag to set (issue 15 item 8): it reads the engine's
`GET /version` beside its /metrics, and says `--max-num-active-seqs` from vLLM 0.32, `--max-num-seqs` before,
in the max_num_seqs advice line and in --json. A kvtune engine, or a vLLM whose /version does not answer, gets
no flag advice."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator

import pytest

from kvtune.cli import main
from kvtune.operator.doctor.admission import engine_base
from tests.operator.helpers import fixture_text, metrics_answer, serve_routes, vllm_asking_long

ARGS = ["--window-seconds", "0.2", "--samples", "2", "--max-num-seqs", "64"]


@pytest.fixture
def vllm() -> Iterator[Callable[[str | None], str]]:
    """Start a vLLM-like server: its scrapes (t0, then t1) and, when given, this /version answer. One
    server per doctor run: each run needs its own t0 -> t1 window."""
    with contextlib.ExitStack() as servers:

        def start(version_body: str | None) -> str:
            routes = {"/metrics": [metrics_answer(vllm_asking_long(t)) for t in ("t0", "t1")]}
            if version_body is not None:
                routes["/version"] = [(200, "application/json", version_body)]
            return servers.enter_context(contextlib.contextmanager(serve_routes)(routes))

        yield start


def lower_line(out: str) -> str:
    return next(line for line in out.splitlines() if "lower_max_num_seqs:" in line)


def test_vllm_0_32_is_told_to_set_max_num_active_seqs(
    vllm: Callable[[str | None], str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = vllm('{"version": "0.32.1"}')
    assert main(["doctor", "--metrics-url", f"{url}/metrics", *ARGS]) == 0
    line = lower_line(capsys.readouterr().out)
    assert "max_num_seqs: 64 → " in line
    recommended = int(line.split("→ ")[1].split()[0])
    assert f"(set --max-num-active-seqs {recommended}: vLLM 0.32.1 from the engine's /version has" in line

    assert main(["doctor", "--metrics-url", vllm('{"version": "0.32.1"}'), "--json", *ARGS]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["admission_flag"]["flag"] == "--max-num-active-seqs"
    assert report["admission_flag"]["vllm_version"] == "0.32.1"
    assert "from the engine's /version" in report["admission_flag"]["why"]


def test_an_older_vllm_is_told_to_set_max_num_seqs(
    vllm: Callable[[str | None], str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--metrics-url", vllm('{"version": "0.11.0+cpu"}'), "--json", *ARGS]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["admission_flag"] == {
        "flag": "--max-num-seqs",
        "why": "vLLM 0.11.0+cpu from the engine's /version lacks --max-num-active-seqs",
        "vllm_version": "0.11.0+cpu",
    }
    lower = next(r for r in report["remedies"] if r["remedy"] == "lower_max_num_seqs")
    assert lower["applicable"]
    assert main(["doctor", "--metrics-url", vllm('{"version": "0.11.0+cpu"}'), *ARGS]) == 0
    assert f"(set --max-num-seqs {lower['recommended']}: vLLM 0.11.0+cpu" in lower_line(
        capsys.readouterr().out
    )


def test_no_flag_advice_without_a_vllm_version(
    vllm: Callable[[str | None], str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--metrics-url", vllm(None), "--json", *ARGS]) == 0
    assert json.loads(capsys.readouterr().out)["admission_flag"] is None
    assert main(["doctor", "--metrics-url", vllm('{"version": "not-a-version"}'), "--json", *ARGS]) == 0
    assert json.loads(capsys.readouterr().out)["admission_flag"] is None


@pytest.fixture
def kvtune_answering_a_version() -> Iterator[str]:
    """A kvtune engine's scrapes (its live max_num_seqs gauge) on a server that also answers /version."""
    scrapes = [metrics_answer(fixture_text(f"kvtune_preempting_{t}.prom")) for t in ("t0", "t1")]
    yield from serve_routes(
        {"/metrics": scrapes, "/version": [(200, "application/json", '{"version": "0.40.0"}')]}
    )


def test_a_kvtune_engine_gets_no_vllm_flag(
    kvtune_answering_a_version: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--metrics-url", kvtune_answering_a_version, *ARGS]) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs: 64 → " in lower_line(out) and "(set --" not in out


def test_engine_base_from_a_metrics_url() -> None:
    assert engine_base("http://vllm:8000/metrics") == "http://vllm:8000"
    assert engine_base("http://vllm:8000/") == "http://vllm:8000"
