"""An engine view and samples for the predicted-move tests."""

from __future__ import annotations

from kvtune.contract import metrics as m
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.sample import EngineView, Histogram, Sample

POOL = 4096


# 400 requests since the engine started: prompts 50-100 tokens, outputs 100-200 (footprint about 225:
# the pool holds about 18 at their full length)
FINISHED = 400.0


def _histogram(low: float, high: float, count: float) -> Histogram:
    buckets = ((low, 0.0), (high, count), (float("inf"), count))
    return Histogram(buckets, count, count * (low + high) / 2)


def sample(t: float, *, preemptions: float, running: float = 16, waiting: float = 8) -> Sample:
    """One scrape of an engine serving a closed loop of running + waiting clients, 40 tokens a second per
    running request."""
    done = FINISHED + 2 * t
    return Sample(
        timestamp=t,
        gauges={m.KV_USAGE: 0.9, m.RUNNING: running, m.WAITING: waiting},
        counters={
            m.PREEMPTIONS: preemptions,
            m.GENERATION_TOKENS: 40 * running * t,
            m.PROMPT_TOKENS: 150 * t,
            m.PREFIX_QUERIES: 150 * t,
            m.PREFIX_HITS: 0.0,
        },
        histograms={
            m.REQUEST_PROMPT_TOKENS: _histogram(50, 100, done),
            m.REQUEST_GENERATION_TOKENS: _histogram(100, 200, done),
        },
        cache_config={"block_size": "16", "kv_cache_size_tokens": str(POOL), "cache_dtype": "auto"},
    )


def engine(max_num_seqs: int) -> EngineView:
    return EngineView(max_num_seqs=max_num_seqs, pool_tokens=POOL, block_size=16, cache_dtype="auto",
                      max_model_len=4096, knobs=frozenset({KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP}))  # fmt: skip
