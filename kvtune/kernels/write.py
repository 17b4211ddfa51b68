"""Store new K/V into their cache slots with torch indexing (reference and CPU backends).

Index assignment on a view of the cache writes in place with no copy of the cache, on any device, which is
all the CPU engine needs; the GPU uses the Triton write kernel, which fuses quantisation into the store.
"""

from __future__ import annotations

import torch

from kvtune.kernels.cache_dtype import to_cache_dtype


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
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = to_cache_dtype(key[keep], kv_cache.dtype, k_scale)
    kv_cache[blocks, 1, offsets] = to_cache_dtype(value[keep], kv_cache.dtype, v_scale)
