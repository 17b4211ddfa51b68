"""`vllm:request_num_preemptions` counts what happened: on a pool too small for the workload, each finished
request is observed once with the times the scheduler evicted it (0 for the others), in vLLM's buckets, and
its sum is the engine's preemption counter."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from engine_loop_driver import BLOCK_SIZE, greedy, make_engine, random_prompt, run_until_idle
from prometheus_client.parser import text_string_to_metric_families

from kvtune.contract.preemptions import REQUEST_PREEMPTIONS_BUCKETS, REQUEST_PREEMPTIONS_SERIES
from kvtune.engine.http.metrics import EngineMetrics
from kvtune.engine.loop.thread import snapshot

REQUESTS = 16
POOL_TOKENS = 20 * BLOCK_SIZE  # sixteen requests of up to 9 blocks each: some evicted 0, 1, 2, 3+ times


def _histogram(text: str) -> tuple[dict[float, float], float, float]:
    """(cumulative count by upper bound, count, sum) of the preemption histogram in an exposition."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{REQUEST_PREEMPTIONS_SERIES}_bucket":
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name == f"{REQUEST_PREEMPTIONS_SERIES}_count":
                count = sample.value
            elif sample.name == f"{REQUEST_PREEMPTIONS_SERIES}_sum":
                total = sample.value
    return buckets, count, total


def test_the_histogram_counts_each_requests_preemptions_under_real_pressure(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, kv_cache_tokens=POOL_TOKENS)
    metrics = EngineMetrics(engine)
    rng = random.Random(7)
    for i in range(REQUESTS):
        engine.add_request(f"r{i}", random_prompt(rng, rng.randrange(10, 40)), greedy(100, ignore_eos=True))
    run_until_idle(engine, on_step=lambda _: metrics.update(snapshot(engine, drain=True)))

    evicted = Counter(p.victim for p in engine.scheduler.preemption_log)
    per_request = [evicted.get(f"r{i}", 0) for i in range(REQUESTS)]
    assert len(engine.scheduler.preemption_log) == engine.counters.num_preemptions  # the log kept them all
    assert {0, 1, 2} <= set(per_request) and max(per_request) >= 3, f"too little pressure: {per_request}"

    buckets, count, total = _histogram(metrics.render().decode())
    assert count == REQUESTS
    assert total == sum(per_request) == engine.counters.num_preemptions
    assert sorted(buckets) == [*REQUEST_PREEMPTIONS_BUCKETS, float("inf")]
    for bound, cumulative in buckets.items():
        assert cumulative == sum(1 for n in per_request if n <= bound), bound
