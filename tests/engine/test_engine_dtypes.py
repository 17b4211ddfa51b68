"""16-bit activations and an FP8 KV cache stay close to the fp32 model: the numerics a GPU or a memory-bound
deployment runs, checked against the exact fp32 path (itself checked against transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_runner import PagedRunner, PagedSequence, backend_params

from kvtune.engine.model.kv_cache import KVCache
from kvtune.engine.model.model import load_model
from kvtune.kernels import FP8_DTYPE

TOKENS = list(range(32, 112))


def _logits(folder: Path, backend: str, dtype: torch.dtype, cache_dtype: str = "auto") -> torch.Tensor:
    model = load_model(folder, dtype=dtype, attention_backend=backend)
    runner = PagedRunner(model)
    runner.cache = KVCache.for_model(
        model.config, 16, num_tokens=1024, cache_dtype=cache_dtype, model_dtype=dtype
    )
    sequence = PagedSequence()
    first = runner.step([(sequence, TOKENS[:50])], all_logits=True)
    rest = [runner.step([(sequence, [token])]) for token in TOKENS[50:]]
    return torch.cat([first, *rest]).float()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_fp8_cache_stay_close(tiny_dir: Path, backend: str, dtype: torch.dtype) -> None:
    exact = _logits(tiny_dir, backend, torch.float32)
    half = _logits(tiny_dir, backend, dtype)
    fp8 = _logits(tiny_dir, backend, dtype, cache_dtype="fp8")
    torch.testing.assert_close(half, exact, atol=0.03, rtol=0)
    torch.testing.assert_close(fp8, half, atol=0.03, rtol=0)
    assert (fp8.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


def test_fp8_cache_holds_fp8(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, attention_backend="reference")
    cache = KVCache.for_model(model.config, 16, num_tokens=64, cache_dtype="fp8")
    assert all(layer.dtype == FP8_DTYPE for layer in cache.layers)
