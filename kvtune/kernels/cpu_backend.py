"""The CPU backend: paged attention read in place from the cache by the C++ kernel (see cpu_build.py).

This is what the engine runs on a machine without a GPU. The kernel walks each sequence's block table and
streams its K/V rows straight from the cache, with no padded gather copy; the measured decode rate is in
BENCHMARKS.md (the kernels-cpu section). Splits (flash-decoding) keep every core busy when there are fewer
sequences than threads; their partials are merged by kvtune.kernels.merge.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from kvtune.errors import KvtuneError
from kvtune.kernels import write as torch_write
from kvtune.kernels.cache_dtype import FP8_DTYPE
from kvtune.kernels.cpu_build import load, selected_isa
from kvtune.kernels.merge import merge_attention_partials

_CACHE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, FP8_DTYPE: 3}
QUERY_TILE = 16
MIN_TOKENS_PER_SPLIT = 512


class _Params(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("cache", ctypes.c_void_p),
        ("stride_block", ctypes.c_int64),
        ("stride_kv", ctypes.c_int64),
        ("stride_token", ctypes.c_int64),
        ("stride_head", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p),
        ("block_table_stride", ctypes.c_int64),
        ("query_start_loc", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("num_seqs", ctypes.c_int32),
        ("num_tokens", ctypes.c_int32),
        ("num_q_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
        ("query_tile", ctypes.c_int32),
        ("cache_type", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
        ("query_bf16", ctypes.c_int32),
    ]


def available() -> str | None:
    """None when the backend can run here, else why not (no compiler, build failure)."""
    try:
        library()
    except KvtuneError as err:
        return str(err)
    return None


def library() -> ctypes.CDLL:
    """The kernel library of the selected ISA variant ($KVTUNE_CPU_ISA, default native), built once."""
    return load(isa=selected_isa())


def default_num_splits(num_seqs: int, seq_lens: torch.Tensor) -> int:
    """Enough key splits for two decode items (sequence x split) per thread, each ≥ MIN_TOKENS_PER_SPLIT. The
    lengths are read only when there are fewer sequences than that: with enough, one split, whatever they are."""
    threads = torch.get_num_threads()
    wanted = -(-2 * threads // max(1, num_seqs))
    if wanted == 1:
        return 1
    return max(1, min(wanted, int(seq_lens.max()) // MIN_TOKENS_PER_SPLIT))


def kernel_params(
    queries: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    scale: float,
    k_scale: float,
    v_scale: float,
    num_splits: int,
    query_tile: int,
    query_bf16: bool,
) -> _Params:
    """The kernel's argument block (the benchmark's probes take the same one); every tensor must be contiguous
    and stay alive for the call."""
    num_tokens, num_q_heads, head_dim = queries.shape
    return _Params(
        q=queries.data_ptr(),
        cache=kv_cache.data_ptr(),
        stride_block=kv_cache.stride(0),
        stride_kv=kv_cache.stride(1),
        stride_token=kv_cache.stride(2),
        stride_head=kv_cache.stride(3),
        block_tables=tables.data_ptr(),
        block_table_stride=tables.stride(0),
        query_start_loc=starts.data_ptr(),
        seq_lens=lengths.data_ptr(),
        out=None if out is None else out.data_ptr(),
        lse=None if lse is None else lse.data_ptr(),
        num_seqs=lengths.shape[0],
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=kv_cache.shape[3],
        head_dim=head_dim,
        block_size=kv_cache.shape[2],
        num_splits=num_splits,
        query_tile=query_tile,
        cache_type=_CACHE_TYPES[kv_cache.dtype],
        num_threads=torch.get_num_threads(),
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        query_bf16=int(query_bf16),
    )


def _attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    num_splits: int,
    query_tile: int,
) -> torch.Tensor:
    if kv_cache.device.type != "cpu":
        raise KvtuneError(f"the cpu backend needs tensors on the cpu, not {kv_cache.device}")
    queries = q.to(torch.float32).contiguous()
    tables = block_tables.contiguous()
    starts = query_start_loc.contiguous()
    lengths = seq_lens.contiguous()
    num_tokens, num_q_heads, head_dim = queries.shape
    out = torch.empty(num_splits, num_tokens, num_q_heads, head_dim, dtype=torch.float32)
    lse = torch.empty(num_splits, num_tokens, num_q_heads, dtype=torch.float32)
    params = kernel_params(
        queries, kv_cache, tables, starts, lengths, out, lse, scale, k_scale, v_scale, num_splits, query_tile,
        q.dtype == torch.bfloat16,
    )  # fmt: skip
    if library().kvt_paged_attention(ctypes.byref(params)) != 0:
        raise KvtuneError(f"cpu attention kernel rejected cache dtype {kv_cache.dtype}")
    merged = out[0] if num_splits == 1 else merge_attention_partials(out, lse)[0]
    return merged.to(q.dtype)


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
    num_seqs = q.shape[0]
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, seq_lens)
    starts = _decode_starts(num_seqs)
    return _attention(q, kv_cache, block_tables, starts, seq_lens, scale, k_scale, v_scale, num_splits, 1)


@cache
def _decode_starts(num_seqs: int) -> torch.Tensor:
    """0, 1, ..., num_seqs: a decode batch's query start of each sequence (one token each), built once per
    batch size instead of once per layer; the kernel only reads it."""
    return torch.arange(num_seqs + 1, dtype=torch.int32)


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
    """The C++ kernel reads each sequence's query length itself; max_query_len sizes nothing here."""
    return _attention(
        q, kv_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale, 1, QUERY_TILE
    )


write_kv = torch_write.write_kv
