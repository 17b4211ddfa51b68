"""Input checks shared by every backend, so a bad call fails with one clear KvtuneError, not deep in a kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtune.core.geometry import KERNEL_BLOCK_MULTIPLE, check_block_size
from kvtune.errors import KvtuneError
from kvtune.kernels.cache_dtype import ACTIVATION_DTYPES, CACHE_DTYPES, FP8_DTYPE


@dataclass(frozen=True)
class CacheGeometry:
    """The shape of one layer's paged cache `[num_blocks, 2, block_size, num_kv_heads, head_dim]`."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def check_cache(kv_cache: torch.Tensor) -> CacheGeometry:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise KvtuneError(
            f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in CACHE_DTYPES:
        raise KvtuneError(f"kv_cache dtype {kv_cache.dtype} is not one of {CACHE_DTYPES}")
    if kv_cache.stride(-1) != 1:
        raise KvtuneError("kv_cache's head_dim must be contiguous")
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    check_block_size(block_size, multiple_of=KERNEL_BLOCK_MULTIPLE, name="block_size", error=KvtuneError)
    return CacheGeometry(num_blocks, block_size, num_kv_heads, head_dim)


def check_query(q: torch.Tensor, geometry: CacheGeometry, kv_cache: torch.Tensor) -> int:
    """Validate q `[tokens, num_q_heads, head_dim]` against the cache; return the GQA group size."""
    if q.dim() != 3:
        raise KvtuneError(f"q must be [tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype not in ACTIVATION_DTYPES:
        raise KvtuneError(f"q dtype {q.dtype} is not one of {ACTIVATION_DTYPES}")
    if q.shape[2] != geometry.head_dim:
        raise KvtuneError(f"q head_dim {q.shape[2]} differs from the cache's {geometry.head_dim}")
    if q.shape[1] % geometry.num_kv_heads != 0:
        raise KvtuneError(
            f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads {geometry.num_kv_heads}"
        )
    if kv_cache.dtype not in (q.dtype, FP8_DTYPE):
        raise KvtuneError(f"kv_cache dtype {kv_cache.dtype} must equal q's {q.dtype} or be float8_e4m3fn")
    if q.device != kv_cache.device:
        raise KvtuneError(f"q is on {q.device} but kv_cache is on {kv_cache.device}")
    return q.shape[1] // geometry.num_kv_heads


def check_int_vector(name: str, values: torch.Tensor, length: int) -> None:
    if values.dim() != 1 or values.shape[0] != length:
        raise KvtuneError(f"{name} must be a vector of {length} entries, got {tuple(values.shape)}")
    if values.dtype != torch.int32:
        raise KvtuneError(f"{name} must be int32, got {values.dtype}")


def check_block_tables(
    block_tables: torch.Tensor, num_seqs: int, seq_lens: torch.Tensor, block_size: int
) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise KvtuneError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype != torch.int32:
        raise KvtuneError(f"block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.device.type != "cpu":
        return  # reading values back from a GPU would stall the stream on every decode step
    if num_seqs and int(seq_lens.max()) > block_tables.shape[1] * block_size:
        raise KvtuneError("a sequence is longer than its block table can address")
    if num_seqs and int(seq_lens.min()) < 1:
        raise KvtuneError("every sequence needs at least one token (seq_lens >= 1)")


def check_query_start_loc(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_query_tokens: int
) -> None:
    """query_start_loc rises from 0 to the query tokens, and no sequence has more new tokens than its seq_len."""
    if query_start_loc.device.type != "cpu" or seq_lens.device.type != "cpu":
        return  # reading values back from a GPU would stall the stream on every prefill call
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if (
        int(query_start_loc[0]) != 0
        or int(query_start_loc[-1]) != num_query_tokens
        or bool((query_lens < 0).any())
    ):
        raise KvtuneError("query_start_loc must rise from 0 to the number of query tokens")
    if bool((query_lens > seq_lens).any()):
        raise KvtuneError("a sequence has more new tokens than its seq_len")


def check_scales(k_scale: float, v_scale: float) -> None:
    if not (k_scale > 0 and v_scale > 0):
        raise KvtuneError(f"k_scale and v_scale must be positive, got {k_scale}, {v_scale}")
