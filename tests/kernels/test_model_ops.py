"""The model's fused CPU ops against the torch code they replace (kvtune/engine/model/model.py's).

Bitwise where the arithmetic is the same operations in the same order: the residual add, RoPE (each product
and the sum rounded to the model dtype) and the cache write. Within float32 rounding where the order differs:
the norm's sum of squares (16 interleaved partial sums, not torch's reduction) and silu's exp (libm, not
torch's vectorised exp). The bound stated and checked: float32 outputs within 4 units in the last place
(rtol 5e-7); bfloat16 outputs bitwise except on under 1% of the elements, where the intermediate (the
normalised value, or silu) rounded to the other side of a bfloat16 midpoint: one bfloat16 unit in the last
place there, at most two after the second rounding (times the norm's weight, or times up).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtune.engine.model.rope import apply_rotary
from kvtune.kernels.model_ops import FusedOps, fused_ops
from kvtune.kernels.write import write_kv

DTYPES = [torch.float32, torch.bfloat16]


def _ops(dtype: torch.dtype) -> FusedOps:
    ops = fused_ops("cpu", dtype)
    if ops is None:
        pytest.fail("the fused CPU ops did not build: g++ is needed (apt-get install g++)")
    return ops


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _assert_within_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=5e-7, atol=1e-7)
        return
    differ = got != expected
    assert differ.float().mean() < 0.01, f"{int(differ.sum())} of {got.numel()} bfloat16 elements differ"
    ulp_apart = (got.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert int(ulp_apart.max()) <= 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 37, 2048])
@pytest.mark.parametrize("cols", [256, 1000])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, rows: int, cols: int) -> None:
    generator = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=generator) * 3).to(dtype)
    delta = torch.randn(rows, cols, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(cols, generator=generator)).to(dtype)
    ops = _ops(dtype)
    total, normed = ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    _assert_within_rounding(normed, _torch_rms_norm(x + delta, weight, 1e-5))
    _assert_within_rounding(ops.rms_norm(x, weight, 1e-6), _torch_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 300])
def test_silu_mul_matches_torch(dtype: torch.dtype, tokens: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * 512, generator=generator) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-200.0, -88.5, -87.5, 87.5, 89.0, 200.0])  # exp's overflow and underflow
    gate, up = gate_up.split(512, dim=-1)
    _assert_within_rounding(_ops(dtype).silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 32), (16, 4, 64), (4, 4, 128)])
def test_rope_and_cache_write_equal_torch_bitwise(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    generator = torch.Generator().manual_seed(dim)
    tokens, block_size, blocks = 45, 16, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=generator) * 100
    doubled = torch.cat((angles, angles), dim=-1)
    cos, sin = doubled.cos().to(dtype).unsqueeze(1), doubled.sin().to(dtype).unsqueeze(1)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    slots[7] = -1  # a padding token: written nowhere
    expected_cache = torch.zeros(blocks, 2, block_size, kv_heads, dim, dtype=dtype)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    expected_q = apply_rotary(q.view(tokens, heads, dim), cos, sin)
    k = apply_rotary(k.view(tokens, kv_heads, dim), cos, sin)
    write_kv(expected_cache, k, v.contiguous().view(tokens, kv_heads, dim), slots, 1.0, 1.0)
    cache = torch.zeros_like(expected_cache)
    got_q = _ops(dtype).rope_write(qkv, cos, sin, slots, cache, heads, kv_heads, dim)
    assert torch.equal(got_q, expected_q)
    assert torch.equal(cache, expected_cache)


def test_only_cpu_float32_and_bfloat16_are_fused() -> None:
    assert fused_ops("cpu", torch.float16) is None
    assert fused_ops("meta", torch.float32) is None
    ops = _ops(torch.bfloat16)
    assert ops.fits_cache(torch.zeros(2, 2, 16, 2, 32, dtype=torch.bfloat16))
    assert not ops.fits_cache(torch.zeros(2, 2, 16, 2, 32, dtype=torch.float32))
    assert not ops.fits_cache(torch.zeros(2, 2, 16, 2, 64, dtype=torch.bfloat16)[..., :32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_splitting_rows_over_threads_changes_no_value(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk's rows go to every thread, a decode step's few to one: the same bits either way."""
    generator = torch.Generator().manual_seed(7)
    rows, heads, kv_heads, dim, block_size = 301, 16, 4, 64, 16
    x, delta = (torch.randn(rows, 1024, generator=generator).to(dtype) for _ in range(2))
    weight = torch.randn(1024, generator=generator).to(dtype)
    gate_up = (torch.randn(rows, 2 * 704, generator=generator) * 4).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    cos, sin = (torch.randn(rows, 1, dim, generator=generator).to(dtype) for _ in range(2))
    slots = torch.randperm(32 * block_size, generator=generator)[:rows]
    ops = _ops(dtype)

    def run() -> list[torch.Tensor]:
        cache = torch.zeros(32, 2, block_size, kv_heads, dim, dtype=dtype)
        q = ops.rope_write(qkv, cos, sin, slots, cache, heads, kv_heads, dim)
        return [*ops.add_rms_norm(x, delta, weight, 1e-5), ops.silu_mul(gate_up), q, cache]

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(3)
        monkeypatch.setattr("kvtune.kernels.model_ops.PARALLEL_MIN_ELEMENTS", 1)
        split = run()
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(one, split, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
