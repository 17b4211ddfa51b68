"""KV-cache element types: which dtypes a cache may hold, their size, and FP8 (e4m3) quantisation.

The engine sizes its block pool with `kv_bytes_per_token`: an FP8 cache stores one byte per element, so the
same memory holds twice the tokens of a bf16 cache. Quantisation lives here, in torch, so that every
backend (and the tests' oracle) rounds exactly the same way.
"""

from __future__ import annotations

import torch

from kvtune.core.geometry import ModelGeometry
from kvtune.errors import KvtuneError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (*ACTIVATION_DTYPES, FP8_DTYPE)

_BY_NAME: dict[str, torch.dtype] = {
    "fp8": FP8_DTYPE,
    "fp8_e4m3": FP8_DTYPE,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Map a `--kv-cache-dtype` value (`auto` = the model's dtype, `fp8`, ...) to a torch dtype."""
    if name == "auto":
        return model_dtype
    if name not in _BY_NAME:
        raise KvtuneError(f"unknown kv cache dtype {name!r}; use auto, fp8, bf16, fp16 or fp32")
    return _BY_NAME[name]


def cache_dtype_name(dtype: torch.dtype) -> str:
    """The name the engine reports as `cache_dtype` (vLLM's spelling: `fp8` for e4m3, else `auto`-style names)."""
    if dtype == FP8_DTYPE:
        return "fp8_e4m3"
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]


def kv_bytes_per_token(
    cache_dtype: torch.dtype, num_kv_heads: int, head_dim: int, num_layers: int = 1
) -> int:
    """Bytes one token occupies in the KV cache (K and V, all KV heads, `num_layers` layers).

    torch knows the element size; kvtune.core.geometry does the pricing, as it does for the simulator.
    """
    if cache_dtype not in CACHE_DTYPES:
        raise KvtuneError(f"unsupported kv cache dtype {cache_dtype}")
    element = torch.empty((), dtype=cache_dtype).element_size()
    return ModelGeometry(num_layers, num_kv_heads, head_dim, element).bytes_per_token


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale rounded to e4m3 (nearest, ties to even), saturated at ±448 instead of overflowing to NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Convert new K or V values to what the cache stores: quantised for FP8, a plain cast otherwise."""
    if cache_dtype == FP8_DTYPE:
        return quantize_fp8(x, scale)
    return x.to(cache_dtype)


def dequantize(cache_values: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Read cache values as `dtype`; FP8 values are multiplied back by their per-tensor scale."""
    values = cache_values.to(dtype)
    if cache_values.dtype == FP8_DTYPE:
        values = values * scale
    return values
