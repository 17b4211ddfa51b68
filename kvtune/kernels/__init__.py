"""Paged-attention kernels for the engine: one interface, three backends, FP8 KV and split-K decode.

Backends: `reference` (torch gather, the oracle), `cpu` (C++ kernel reading blocks in place), `triton`
(GPU). `select_backend(device)` picks triton on CUDA and cpu elsewhere.
"""

from kvtune.kernels.api import paged_decode_attention, paged_prefill_attention, write_kv
from kvtune.kernels.backends import BACKEND_NAMES, select_backend, unavailable_reason
from kvtune.kernels.cache_dtype import (
    FP8_DTYPE,
    cache_dtype_name,
    kv_bytes_per_token,
    quantize_fp8,
    resolve_cache_dtype,
)
from kvtune.kernels.merge import merge_attention_partials

__all__ = [
    "BACKEND_NAMES",
    "FP8_DTYPE",
    "cache_dtype_name",
    "kv_bytes_per_token",
    "merge_attention_partials",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_fp8",
    "resolve_cache_dtype",
    "select_backend",
    "unavailable_reason",
    "write_kv",
]
