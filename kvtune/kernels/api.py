"""The one interface the engine calls: paged decode, paged prefill and the cache write.

Each call checks its inputs (one KvtuneError with a clear message for a bad call), then runs the chosen
backend; `backend=None` means `select_backend(q.device)`. The checks read tensor values only when they are
on the CPU: on a GPU that read would stall the stream. The engine's model does not come through here on
every layer; it holds a resolved `Backend` and its batch builder checks the lengths once per step.

Cache layout (per layer): `kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]`, index 0 = K, 1 = V.
Token t of sequence s lives in block `block_tables[s, t // block_size]`, offset `t % block_size`.
"""

from __future__ import annotations

import torch

from kvtune.errors import KvtuneError
from kvtune.kernels.backends import resolve_backend
from kvtune.kernels.cache_dtype import FP8_DTYPE
from kvtune.kernels.checks import (
    check_block_tables,
    check_cache,
    check_int_vector,
    check_query,
    check_query_start_loc,
    check_scales,
)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: str | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its whole cached context (the token included).

    q `[num_seqs, num_q_heads, head_dim]`; block_tables int32 `[num_seqs, max_blocks]`; seq_lens int32
    `[num_seqs]` (≥ 1). FP8 caches are dequantised in-kernel with the per-tensor k_scale / v_scale.
    num_splits splits each context into that many key ranges (flash-decoding); None lets the backend decide.
    Returns `[num_seqs, num_q_heads, head_dim]` in q's dtype.
    """
    geometry = check_cache(kv_cache)
    check_query(q, geometry, kv_cache)
    check_int_vector("seq_lens", seq_lens, q.shape[0])
    check_block_tables(block_tables, q.shape[0], seq_lens, geometry.block_size)
    check_scales(k_scale, v_scale)
    if num_splits is not None and num_splits < 1:
        raise KvtuneError(f"num_splits must be at least 1, got {num_splits}")
    chosen = resolve_backend(backend, q.device)
    return chosen.decode(q, kv_cache, block_tables, seq_lens, scale, k_scale, v_scale, num_splits)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of a chunk of new tokens per sequence over its cached prefix and, causally, itself.

    q is varlen `[total_new_tokens, num_q_heads, head_dim]`: sequence s owns rows
    `query_start_loc[s]:query_start_loc[s + 1]` (int32, `[num_seqs + 1]`, vLLM's cu_seqlens_q). seq_lens counts
    context + new tokens, so the context length is `seq_lens[s] - query_len[s]`, and query i of s sees keys
    0..context + i. The chunk's K/V must already be written (write_kv) before this call.
    """
    geometry = check_cache(kv_cache)
    check_query(q, geometry, kv_cache)
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_int_vector("seq_lens", seq_lens, num_seqs)
    check_int_vector("query_start_loc", query_start_loc, num_seqs + 1)
    check_block_tables(block_tables, num_seqs, seq_lens, geometry.block_size)
    check_scales(k_scale, v_scale)
    check_query_start_loc(query_start_loc, seq_lens, q.shape[0])
    chosen = resolve_backend(backend, q.device)
    return chosen.prefill(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale)


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    backend: str | None = None,
) -> None:
    """Store new tokens' K and V `[num_tokens, num_kv_heads, head_dim]` at slot_mapping's slots, in place.

    slot = block * block_size + offset; a negative slot skips its token (padding). An FP8 cache stores
    `x / scale` rounded to e4m3 and saturated at ±448.
    """
    geometry = check_cache(kv_cache)
    expected = (
        slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1,
        geometry.num_kv_heads,
        geometry.head_dim,
    )
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != expected:
            raise KvtuneError(
                f"{name} must be [num_tokens, num_kv_heads, head_dim] = {expected}, got {tuple(tensor.shape)}"
            )
        if tensor.stride(-1) != 1:
            raise KvtuneError(f"{name}'s head_dim must be contiguous")
        if kv_cache.dtype not in (tensor.dtype, FP8_DTYPE):
            raise KvtuneError(f"{name} dtype {tensor.dtype} does not match the cache's {kv_cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise KvtuneError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    capacity = geometry.num_blocks * geometry.block_size
    # Read back only on the CPU: on a GPU it would stall the stream on every layer.
    if slot_mapping.device.type == "cpu" and slot_mapping.numel() and int(slot_mapping.max()) >= capacity:
        raise KvtuneError(f"a slot is beyond the cache's {capacity} slots")
    check_scales(k_scale, v_scale)
    resolve_backend(backend, kv_cache.device).write_kv(kv_cache, key, value, slot_mapping, k_scale, v_scale)
