"""What the operator knows of an engine's configuration: its live knobs, its KV pool, and which knobs an
actuator can change on it. Built from the metrics (`cache_config_info`, kvtune's live gauges) plus what the
caller knows (a Deployment's args, the admin API)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtune.contract.metrics import MAX_NUM_SEQS, MAX_TOKENS_CAP
from kvtune.operator.decide.sample import Sample


@dataclass(frozen=True)
class EngineView:
    max_num_seqs: int | None = None
    max_tokens_cap: int | None = None
    pool_tokens: int | None = None
    block_size: int | None = None
    cache_dtype: str | None = None
    max_model_len: int | None = None
    knobs: frozenset[str] = frozenset()  # what an actuator can change on this engine


def _int(text: str | None) -> int | None:
    try:
        return int(float(text)) if text is not None else None
    except ValueError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def engine_view_from_sample(sample: Sample | None, known: EngineView | None = None) -> EngineView:
    """Fill an EngineView from one sample; values in `known` (from the caller) win over the metrics."""
    view = EngineView()
    if sample is not None:
        config = sample.cache_config
        block_size = _int(config.get("block_size"))
        pool = _int(config.get("kv_cache_size_tokens"))
        blocks = _int(config.get("num_blocks"))
        if pool is None and blocks is not None and block_size is not None:
            pool = blocks * block_size
        max_model_len = _int(config.get("max_model_len"))
        concurrency = _float(config.get("kv_cache_max_concurrency"))
        if max_model_len is None and pool and concurrency:
            max_model_len = round(pool / concurrency)
        seqs = sample.gauges.get(MAX_NUM_SEQS)
        cap = sample.gauges.get(MAX_TOKENS_CAP)
        view = EngineView(
            max_num_seqs=int(seqs) if seqs else None,
            max_tokens_cap=int(cap) if cap else None,
            pool_tokens=pool,
            block_size=block_size,
            cache_dtype=config.get("cache_dtype"),
            max_model_len=max_model_len,
        )
    if known is None:
        return view
    overrides = {key: value for key, value in known.__dict__.items() if value not in (None, frozenset())}
    return replace(view, **overrides)
