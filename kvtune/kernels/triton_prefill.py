# mypy: allow-untyped-decorators, disallow-untyped-defs=False, disallow-incomplete-defs=False
# Triton reads parameter annotations as kernel argument types, so the @triton.jit functions stay unannotated.
"""Triton paged prefill: a chunk of new tokens per sequence attends to the cached context and causally to itself.

The chunk's own K/V must already be in the cache (write_kv first), so one code path reads everything through
the block table, exactly as decode does. Queries are varlen (`query_start_loc`), and a program takes
BLOCK_Q query tokens of one sequence times the G query heads of one KV head as the rows of its dots; keys
past the last query's causal bound are never visited.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.triton_common import dot_dtype, dot_precision, interpreted, padded

LOG2E = 1.4426950408889634
TILE = 64


@triton.jit
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    v_scale,
    stride_q_token,
    stride_q_head,
    stride_c_block,
    stride_c_kv,
    stride_c_token,
    stride_c_head,
    stride_table,
    stride_o_token,
    stride_o_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    first_query = q_block * BLOCK_Q
    if first_query >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - query_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    local_query = first_query + rows // GROUP_PAD
    group_row = rows % GROUP_PAD
    row_ok = (local_query < query_len) & (group_row < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * GROUP + group_row
    q_rows = (query_start + local_query).to(tl.int64) * stride_q_token + q_heads * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
    causal_bound = context + local_query  # the last key each row may see

    row_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    head_offset = kv_head.to(tl.int64) * stride_c_head
    key_end = tl.minimum(seq_len, context + first_query + BLOCK_Q)
    for tile_start in range(0, key_end, TILE):
        tokens = tile_start + tl.arange(0, TILE)
        token_ok = tokens < key_end
        block = tl.load(table + tokens // BLOCK_SIZE, mask=token_ok, other=0).to(tl.int64)
        row = block * stride_c_block + (tokens % BLOCK_SIZE).to(tl.int64) * stride_c_token + head_offset
        load_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(cache_ptr + row[:, None] + dims[None, :], mask=load_mask, other=0.0).to(tl.float32)
        v = tl.load(cache_ptr + stride_c_kv + row[:, None] + dims[None, :], mask=load_mask, other=0.0)
        v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        visible = token_ok[None, :] & (tokens[None, :] <= causal_bound[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - safe_max)
        probs = tl.exp2(scores - safe_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        row_max = new_max

    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None] * v_scale
    o_rows = (query_start + local_query).to(tl.int64) * stride_o_token + q_heads * stride_o_head
    tl.store(
        out_ptr + o_rows[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """`max_query_len`, when the caller knows it on the host, sizes the grid without a device-to-host read."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    rows = 16 if interpreted() else 64
    block_q = max(1, rows // group_pad)
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * k_scale * LOG2E,
        v_scale,
        q.stride(0),
        q.stride(1),
        *kv_cache.stride()[:4],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=padded(head_dim),
        BLOCK_SIZE=block_size,
        TILE=TILE,
        DOT_DTYPE=dot_dtype(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
    )
    return out
