"""The cache write on every backend: slots, skipped padding, FP8 quantisation, and bytes per token."""

from __future__ import annotations

import pytest
import torch
from paged_inputs import DEVICE, skip_unavailable

from kvtune.errors import KvtuneError
from kvtune.kernels import FP8_DTYPE, kv_bytes_per_token, quantize_fp8, write_kv
from kvtune.kernels.cache_dtype import resolve_cache_dtype
from kvtune.kernels.triton_common import interpreted

BACKENDS = ["reference", "cpu", "triton"]


def _write(backend: str, dtype: torch.dtype, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor):
    cache = torch.full((4, 2, 16, 2, 32), float("nan")).to(dtype).to(DEVICE)
    write_kv(cache, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), 0.5, 0.25, backend=backend)
    return cache.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_puts_each_token_in_its_slot_and_skips_negative_slots(backend, dtype):
    skip_unavailable(backend)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(5, 2, 32, generator=gen).to(dtype)
    value = torch.randn(5, 2, 32, generator=gen).to(dtype)
    slots = torch.tensor([63, 0, -1, 17, 40])
    cache = _write(backend, dtype, key, value, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(cache[slot // 16, 0, slot % 16], key[token])
        assert torch.equal(cache[slot // 16, 1, slot % 16], value[token])
    assert int(torch.isnan(cache.float()).any(dim=(-1, -2)).sum()) == 4 * 2 * 16 - 2 * 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_write_quantises_with_the_per_tensor_scales(backend):
    """Values that are exact in e4m3 after scaling round-trip exactly on every backend."""
    skip_unavailable(backend)
    grid = torch.tensor([0.0, 0.125, -0.5, 1.0, 1.75, -3.0, 6.5, 240.0, -448.0])
    exact = grid[torch.randint(0, len(grid), (3, 2, 32), generator=torch.Generator().manual_seed(2))]
    cache = _write(backend, FP8_DTYPE, exact * 0.5, exact * 0.25, torch.tensor([1, 2, 3]))
    assert torch.equal(cache[0, 0, 1:4].float(), exact)
    assert torch.equal(cache[0, 1, 1:4].float(), exact)


@pytest.mark.skipif(
    interpreted() or DEVICE.type != "cuda", reason="fp32->fp8 casts are mis-rounded when interpreted"
)
def test_triton_fp8_write_matches_torch_quantisation_on_random_values():
    key = torch.randn(64, 2, 32) * 40
    cache = _write("triton", FP8_DTYPE, key, key, torch.arange(64))
    stored = cache[:, 0].reshape(64, 2, 32).float()
    torch.testing.assert_close(stored, quantize_fp8(key, 0.5).float(), rtol=0.0625, atol=1e-3)


def test_quantize_saturates_instead_of_overflowing():
    quantised = quantize_fp8(torch.tensor([1e6, -1e6, 3.0]), 1.0).float()
    assert quantised.tolist() == [448.0, -448.0, 3.0]


def test_fp8_cache_holds_twice_the_tokens_of_bf16():
    assert kv_bytes_per_token(torch.bfloat16, 8, 128) == 2 * 8 * 128 * 2
    assert kv_bytes_per_token(FP8_DTYPE, 8, 128) * 2 == kv_bytes_per_token(torch.bfloat16, 8, 128)
    assert kv_bytes_per_token(FP8_DTYPE, 8, 128, num_layers=36) == 36 * 2 * 8 * 128


def test_cache_dtype_names():
    assert resolve_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_cache_dtype("fp8", torch.bfloat16) == FP8_DTYPE
    with pytest.raises(KvtuneError, match="unknown kv cache dtype"):
        resolve_cache_dtype("int4", torch.bfloat16)


def test_write_rejects_slots_beyond_the_cache():
    key = torch.zeros(1, 2, 32)
    with pytest.raises(KvtuneError, match="beyond the cache"):
        _write("reference", torch.float32, key, key, torch.tensor([64]))
