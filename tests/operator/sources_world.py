"""SGLang's recorded exposition for the source-name tests."""

from __future__ import annotations

SGLANG = """\
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.93
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 48
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 12
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="m"} 7
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.41
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="m",cache_source="device"} 300
sglang:cached_tokens_total{model_name="m",cache_source="host"} 100
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 1000
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{model_name="m",page_size="1",num_pages="200000"} 1
"""
