# mypy: allow-untyped-decorators, disallow-untyped-defs=False, disallow-incomplete-defs=False
# Triton reads parameter annotations as kernel argument types, so the @triton.jit functions stay unannotated.
"""Triton paged decode: one program per (sequence, KV head, key split), holding the G query heads that share
the KV head, so each K/V tile is read once and fed to a tensor-core dot.

Keys are walked in tiles of TILE tokens; each token looks up its own block, so the tile size is independent
of the cache's block size (any multiple of 16 works, 16 to 256 and beyond). Softmax is online in base 2.
With more than one split each program writes a float32 partial and its log-sum-exp, and a second kernel
merges the partials exactly (the same arithmetic as kvtune.kernels.merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.triton_common import dot_dtype, dot_precision, interpreted, padded

LOG2E = 1.4426950408889634
TILE = 64
MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def _decode_kernel(
    q_ptr,
    cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_ptr,
    lse_ptr,
    qk_scale,
    v_scale,
    stride_q_seq,
    stride_q_head,
    stride_c_block,
    stride_c_kv,
    stride_c_token,
    stride_c_head,
    stride_table,
    stride_o_seq,
    stride_o_head,
    stride_p_split,
    stride_p_seq,
    stride_p_head,
    stride_l_split,
    stride_l_seq,
    tokens_per_split,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    q = (q * qk_scale).to(DOT_DTYPE)

    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    head_offset = kv_head.to(tl.int64) * stride_c_head
    for tile_start in range(start, end, TILE):
        tokens = tile_start + tl.arange(0, TILE)
        token_ok = tokens < end
        block = tl.load(table + tokens // BLOCK_SIZE, mask=token_ok, other=0).to(tl.int64)
        row = block * stride_c_block + (tokens % BLOCK_SIZE).to(tl.int64) * stride_c_token + head_offset
        load_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(cache_ptr + row[:, None] + dims[None, :], mask=load_mask, other=0.0).to(tl.float32)
        v = tl.load(cache_ptr + stride_c_kv + row[:, None] + dims[None, :], mask=load_mask, other=0.0)
        v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        row_max = new_max

    has_keys = row_sum > 0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, row_sum, 1.0)[:, None], 0.0) * v_scale
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        partial = partial_ptr + split * stride_p_split + seq * stride_p_seq
        tl.store(partial + q_heads[:, None] * stride_p_head + dims[None, :], out, mask=store_mask)
        log2_sum = row_max + tl.log2(tl.where(has_keys, row_sum, 1.0))
        lse = tl.where(has_keys, log2_sum * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + split * stride_l_split + seq * stride_l_seq + q_heads, lse, mask=row_ok)
    else:
        target = out_ptr + seq * stride_o_seq + q_heads[:, None] * stride_o_head + dims[None, :]
        tl.store(target, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_p_split,
    stride_p_seq,
    stride_p_head,
    stride_l_split,
    stride_l_seq,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_ok = splits < num_splits
    lse = tl.load(
        lse_ptr + splits * stride_l_split + seq * stride_l_seq + head, mask=split_ok, other=float("-inf")
    )
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse - top)
    total = tl.sum(weights, axis=0)
    partial = tl.load(
        partial_ptr
        + splits[:, None] * stride_p_split
        + seq * stride_p_seq
        + head * stride_p_head
        + dims[None, :],
        mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    merged = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    target = out_ptr + seq * stride_o_seq + head * stride_o_head + dims
    tl.store(target, merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split keys until there are about two programs per SM, keeping each split ≥ MIN_TOKENS_PER_SPLIT tokens."""
    if interpreted() or device.type != "cuda":
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-2 * sms // programs)
    return max(1, min(wanted, max_seq_len // MIN_TOKENS_PER_SPLIT, 64))


def decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    num_splits: int | None,
) -> torch.Tensor:
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size  # an upper bound that needs no device-to-host read
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_len, q.device)
    tokens_per_split = -(-max_len // num_splits)
    tokens_per_split = -(-tokens_per_split // TILE) * TILE
    num_splits = -(-max_len // tokens_per_split)
    out = torch.empty_like(q)
    split = num_splits > 1
    shape = (num_splits, num_seqs, num_q_heads) if split else (1, 1, 1)
    partial = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    head_dim_pad = padded(head_dim)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        partial,
        lse,
        scale * k_scale * LOG2E,
        v_scale,
        q.stride(0),
        q.stride(1),
        *kv_cache.stride()[:4],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *partial.stride()[:3],
        lse.stride(0),
        lse.stride(1),
        tokens_per_split,
        GROUP=group,
        GROUP_PAD=padded(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE=TILE,
        DOT_DTYPE=dot_dtype(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        SPLIT=split,
    )
    if split:
        _merge_kernel[(num_seqs, num_q_heads)](
            partial,
            lse,
            out,
            num_splits,
            *partial.stride()[:3],
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=padded(num_splits, 2),
        )
    return out
