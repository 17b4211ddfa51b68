"""Store new K/V into their cache slots with torch indexing (reference and CPU backends).

Index assignment on a view of the cache writes in place with no copy of the cache, on any device, which is
all the CPU engine needs; the GPU uses the Triton write kernel, which fuses quantisation into the store.
"""

from __future__ import annotations

import torch

from kvtune.kernels.cache_dtype import FP8_DTYPE, to_cache_dtype


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """Write token i's key/value to slot `slot_mapping[i]` (block * block_size + offset); slots < 0 are skipped."""
    block_size = kv_cache.shape[2]
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if not kv_cache.is_contiguous():
        slots = slot_mapping.long()
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[blocks, 0, offsets] = to_cache_dtype(key, kv_cache.dtype, k_scale)
        kv_cache[blocks, 1, offsets] = to_cache_dtype(value, kv_cache.dtype, v_scale)
        return
    # Rows of [blocks x (K, V) x block_size]: slot s of block b is row 2 b block_size + s % block_size for K,
    # block_size further for V. Two index_copy_ calls, a third less time than advanced-index assignment.
    slots = slot_mapping.long()
    rows = slots + (slots // block_size) * block_size
    # index_copy_ has no FP8 kernel: FP8 rows travel as their bytes.
    as_stored = torch.uint8 if kv_cache.dtype == FP8_DTYPE else kv_cache.dtype
    flat = kv_cache.view(-1, *kv_cache.shape[3:]).view(as_stored)
    flat.index_copy_(0, rows, to_cache_dtype(key, kv_cache.dtype, k_scale).view(as_stored))
    flat.index_copy_(0, rows + block_size, to_cache_dtype(value, kv_cache.dtype, v_scale).view(as_stored))
