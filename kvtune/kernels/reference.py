"""The torch reference backend: gather each sequence's blocks, then plain softmax attention.

It is the oracle every other backend is tested against, so it favours obviousness over speed: it gathers
the blocks into a padded dense tensor (the copy the other backends avoid), computes in float32 (float64 when
q is float64, which the tests use) and works on any device.
"""

from __future__ import annotations

import torch

from kvtune.kernels.cache_dtype import dequantize


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _gather(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, kv: int, length: int, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """The first `length` tokens of K (kv=0) or V (kv=1) of every row of `block_tables`: [B, length, Hkv, D]."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-length // block_size)
    blocks = kv_cache[block_tables[:, :num_blocks].long(), kv]
    tokens = blocks.reshape(blocks.shape[0], num_blocks * block_size, *blocks.shape[3:])[:, :length]
    return dequantize(tokens, scale, dtype)


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
    """Padded gather of every sequence's context, one batched masked softmax (num_splits does not apply)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    dtype = _compute_dtype(q)
    max_len = int(seq_lens.max())
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].long()
    keys = _gather(kv_cache, block_tables, 0, max_len, k_scale, dtype)
    values = _gather(kv_cache, block_tables, 1, max_len, v_scale, dtype)
    # Padding slots may hold anything (NaN in the tests): zero them so 0 * NaN cannot leak into the output.
    keys = torch.where(valid[:, :, None, None], keys, 0)
    values = torch.where(valid[:, :, None, None], values, 0)
    queries = q.to(dtype).view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", queries, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, values)
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)


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
    """One sequence at a time: its new tokens attend to its whole context and causally to each other
    (max_query_len sizes nothing here)."""
    num_kv_heads = kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    dtype = _compute_dtype(q)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for seq, length in enumerate(seq_lens.tolist()):
        first, last = starts[seq], starts[seq + 1]
        if last == first:
            continue
        table = block_tables[seq : seq + 1]
        keys = _gather(kv_cache, table, 0, length, k_scale, dtype)[0].repeat_interleave(group, dim=1)
        values = _gather(kv_cache, table, 1, length, v_scale, dtype)[0].repeat_interleave(group, dim=1)
        queries = q[first:last].to(dtype)
        context = length - (last - first)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_pos = context + torch.arange(last - first, device=q.device)
        future = torch.arange(length, device=q.device)[None, :] > query_pos[:, None]
        scores = scores.masked_fill(future[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[first:last] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
