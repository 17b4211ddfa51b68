# mypy: allow-untyped-decorators, disallow-untyped-defs=False, disallow-incomplete-defs=False
# Triton reads parameter annotations as kernel argument types, so the @triton.jit functions stay unannotated.
"""Triton cache write: one program per new token stores its K and V rows into slot_mapping's slot.

FP8 caches are quantised in the store (x / scale, saturated at ±448, rounded by the hardware cast). The
Triton interpreter's float32→fp8 cast mis-rounds mantissa carries, so interpreted runs with an FP8 cache
quantise in torch (kvtune.kernels.cache_dtype.quantize_fp8) and the kernel only copies the bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.cache_dtype import FP8_DTYPE, FP8_MAX, quantize_fp8
from kvtune.kernels.triton_common import interpreted, padded


@triton.jit
def _write_kernel(
    key_ptr,
    value_ptr,
    slots_ptr,
    cache_ptr,
    inv_k_scale,
    inv_v_scale,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_c_block,
    stride_c_kv,
    stride_c_token,
    stride_c_head,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
    block = slot // BLOCK_SIZE
    target = cache_ptr + block * stride_c_block + (slot % BLOCK_SIZE) * stride_c_token
    target = target + heads[:, None] * stride_c_head + dims[None, :]
    k = tl.load(key_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(
        value_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask
    )
    if QUANTIZE:
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -FP8_LIMIT, FP8_LIMIT)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -FP8_LIMIT, FP8_LIMIT)
    tl.store(target, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(target + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    quantize = kv_cache.dtype == FP8_DTYPE
    if quantize and interpreted():
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
        quantize = False
    elif not quantize:
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    _write_kernel[(num_tokens,)](
        key,
        value,
        slot_mapping,
        kv_cache,
        1.0 / k_scale,
        1.0 / v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *kv_cache.stride()[:4],
        NUM_HEADS=num_heads,
        HEADS_PAD=padded(num_heads, 1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=padded(head_dim, 1),
        BLOCK_SIZE=kv_cache.shape[2],
        QUANTIZE=quantize,
        FP8_LIMIT=FP8_MAX,
    )
