"""`kvtune bench serve` against the live server, and the vLLM-worded boot and stats log lines."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from kvtune.cli import main
from kvtune.engine.command import log_capacity
from kvtune.engine.http.stats_log import StatsLine
from kvtune.engine.loop.llm_engine import EngineCounters
from kvtune.engine.loop.thread import EngineStats
from tests.server.live_server import LiveServer

PERCENTILES = {"p50", "p90", "p99"}


def run_bench(server: LiveServer, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--url", f"{server.url}/v1", "--model", "tiny", "--json", str(out), *extra]
    assert main(argv) == 0
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def test_bench_serve_prints_a_table_and_writes_json(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.wait_idle()
    summary = run_bench(
        server, tmp_path, "--num-requests", "16", "--concurrency", "16", "--prompt-len", "uniform:80:120",
        "--output-len", "uniform:60:100", "--ignore-eos", "--shared-prefix", "48", "--shared-fraction", "0.5",
    )  # fmt: skip
    table = capsys.readouterr().out
    for row in ("requests ok / failed", "generated tokens/s", "TTFT p50 / p90 / p99", "ITL p50 / p90 / p99"):
        assert row in table
    assert re.search(r"preemptions \(server delta\)\s+\d+", table)
    assert summary["requests_ok"] == 16 and summary["requests_failed"] == 0
    assert 16 * 60 <= summary["generated_tokens"] <= 16 * 100
    assert summary["generated_tokens_per_s"] > 0
    assert summary["total_tokens_per_s"] > summary["generated_tokens_per_s"]
    assert set(summary["ttft_ms"]) == PERCENTILES and set(summary["itl_ms"]) == PERCENTILES
    assert isinstance(summary["preemptions"], int) and summary["preemptions"] > 0  # 16 x ~180 tokens > 1024
    assert summary["duration_s"] > 0


def test_bench_declared_max_tokens_above_the_true_length(server: LiveServer, tmp_path: Path) -> None:
    """The client stops reading at the drawn length; the server aborts the rest and frees its blocks."""
    server.wait_idle()
    aborts = server.counters().finished.get("abort", 0)
    summary = run_bench(
        server, tmp_path, "--num-requests", "4", "--prompt-len", "fixed:40", "--output-len", "fixed:10",
        "--max-tokens", "500", "--ignore-eos", "--request-rate", "50",
    )  # fmt: skip
    assert summary["requests_ok"] == 4 and summary["generated_tokens"] == 40
    server.wait_idle()
    assert server.counters().finished.get("abort", 0) == aborts + 4
    assert server.blocks_held() == 0


def test_bench_against_a_dead_url_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--model", "x", "--num-requests", "2"])
    assert code == 1
    assert "requests ok / failed        0 / 2" in capsys.readouterr().out


def test_boot_log_lines_use_vllm_wording(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        log_capacity(server.built.engine)
    text = caplog.text
    size = re.search(r"CPU KV cache size: ([\d,]+) tokens", text)
    concurrency = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text)
    assert size and size.group(1) == "1,024"
    assert concurrency and concurrency.group(1) == f"{server.built.engine.max_model_len:,}"
    assert concurrency.group(2) == "1.00"


def stats(generated: int, preemptions: int, hits: int = 0, queries: int = 0) -> EngineStats:
    counters = EngineCounters(
        num_preemptions=preemptions, prefix_cache_queries=queries, prefix_cache_hits=hits,
        prompt_tokens=100, generation_tokens=generated,
    )  # fmt: skip
    return EngineStats(counters, 3, 2, 0.5, 0.9, 7, 8, None)


def test_stats_line_shows_preemptions_only_when_there_were_any() -> None:
    line = StatsLine(stats(0, 0), now=0.0)
    text, busy = line.format(stats(50, 0, hits=25, queries=100), now=5.0)
    assert busy
    assert text == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 25.0%"
    )
    text, _ = line.format(stats(50, 4), now=10.0)
    assert text.endswith(", Preemptions: 4")
    assert "Avg generation throughput: 0.0 tokens/s" in text
