"""/metrics carries every vLLM name the dashboards and rules use, plus kvtune's, in text format 0.0.4."""

from __future__ import annotations

import httpx

from tests.server.live_server import LiveServer, scrape, total

COUNTERS = [
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "kvtune:capped_requests_total",
]
GAUGES = [
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:cache_config_info",
    "kvtune:kv_effective_utilization",
    "kvtune:kv_held_empty_slots",
    "kvtune:max_num_seqs",
    "kvtune:max_tokens_cap",
]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_num_preemptions",
]


def test_every_name_is_exposed_with_model_and_engine_labels(client: httpx.Client) -> None:
    samples = scrape(client)
    wanted = COUNTERS + GAUGES + [f"{h}_{part}" for h in HISTOGRAMS for part in ("bucket", "count", "sum")]
    for name in wanted:
        assert name in samples, f"{name} is missing from /metrics"
        for labels, _ in samples[name]:
            assert labels.get("model_name") == "tiny", name
            assert labels.get("engine") == "0", name


def test_cache_config_info_describes_the_pool(client: httpx.Client, server: LiveServer) -> None:
    ((labels, value),) = scrape(client)["vllm:cache_config_info"]
    engine = server.built.engine
    assert value == 1
    assert labels["block_size"] == "16"
    assert labels["num_gpu_blocks"] == str(engine.cache.num_blocks)
    assert labels["kv_cache_size_tokens"] == "1024"
    assert labels["cache_dtype"] == "auto"
    assert labels["enable_prefix_caching"] == "True"
    assert float(labels["kv_cache_max_concurrency"]) == 1024 / engine.max_model_len


def test_counters_and_histograms_move_after_traffic(client: httpx.Client, server: LiveServer) -> None:
    before = scrape(client)
    for _ in range(2):
        body = {"prompt": "x" * 40, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
    server.wait_idle()
    after = scrape(client)
    assert total(after, "vllm:generation_tokens_total") - total(before, "vllm:generation_tokens_total") == 10
    assert total(after, "vllm:prompt_tokens_total") - total(before, "vllm:prompt_tokens_total") == 82
    assert total(after, "vllm:prefix_cache_queries_total") > total(before, "vllm:prefix_cache_queries_total")
    # The second identical prompt reuses the first one's full blocks.
    assert total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total") >= 32
    length = [v for labels, v in after["vllm:request_success_total"] if labels["finished_reason"] == "length"]
    length_before = [
        v for labels, v in before["vllm:request_success_total"] if labels["finished_reason"] == "length"
    ]
    assert length[0] - length_before[0] == 2
    for name in HISTOGRAMS:
        assert total(after, f"{name}_count") >= total(before, f"{name}_count"), name
    assert (
        total(after, "vllm:e2e_request_latency_seconds_count")
        - total(before, "vllm:e2e_request_latency_seconds_count")
        == 2
    )
    assert (
        total(after, "vllm:inter_token_latency_seconds_count")
        - total(before, "vllm:inter_token_latency_seconds_count")
        == 8
    )
    assert total(after, "vllm:kv_cache_usage_perc") == 0.0
    assert total(after, "kvtune:max_num_seqs") == 8
