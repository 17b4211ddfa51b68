"""What newer vLLMs say about preemptions beyond `vllm:num_preemptions_total`, as read in vLLM's code.

The per-request histogram tells a request preempted five times from five requests preempted once; the
by-reason counter tells KV-pressure preemptions from the others. Read in vLLM's released wheels (PyPI;
the commits are the ones each wheel's vllm/_version.py names):

- `vllm:request_num_preemptions` (vllm#49984): a histogram labelled `model_name` and `engine`, observed once
  for every finished request, never-preempted ones included (value 0), with the buckets below
  (`REQUEST_NUM_PREEMPTIONS_BUCKETS` in vllm/v1/metrics/buckets.py, observed in `PrometheusStatLogger.record`
  from `FinishedRequestStats.num_preemptions`). First released in vLLM 0.30.0 (commit ced6857af); 0.29.0
  (98dff2a81) lacks it; unchanged through 0.34.0 (62d4bc3c7). Its first bucket holds 0 and 1 together, so
  "preempted once" is only known from `_sum` where no request went past the last single-count bucket.
- `vllm:num_preemptions_by_reason` (a counter, so exposed as `..._total`) is proposed by vllm#58037 with
  `reason` in kv_full, priority, prefix_cache_reset, summing to `vllm:num_preemptions`. No release through
  0.34.0 has it (the PR was open when read), so kvtune serve does not export it; the operator reads it under
  the proposed name, should it land as proposed.
"""

from __future__ import annotations

REQUEST_PREEMPTIONS_SERIES = "vllm:request_num_preemptions"
PREEMPTIONS_BY_REASON_SERIES = "vllm:num_preemptions_by_reason_total"
REQUEST_PREEMPTIONS_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)

# In vLLM 0.34.0 the scheduler preempts at two places only: when `allocate_slots` finds no free block for a
# running request (the PRIORITY policy changes only which request is evicted: the PR's `priority`), and in
# `reset_prefix_cache(reset_running_requests=True)`. So `kv_full` and `priority` are KV pressure, which
# fewer residents relieve, and `prefix_cache_reset` is not. A reason kvtune does not know counts as KV
# pressure, as every preemption did before vLLM gave reasons; the evidence names it.
KV_PRESSURE_REASONS = frozenset({"kv_full", "priority"})
NOT_KV_PRESSURE_REASONS = frozenset({"prefix_cache_reset"})
