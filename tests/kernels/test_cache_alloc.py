"""The KV cache the kernels read is allocated in the paged layout [blocks, K/V, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from kvtune.kernels.cache_alloc import allocate_kv_cache


def test_allocated_cache_has_the_paged_layout():
    cache = allocate_kv_cache(7, 16, 2, 32, torch.bfloat16)
    assert cache.shape == (7, 2, 16, 2, 32) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    cache.fill_(1.5)
    assert float(cache.float().sum()) == 1.5 * cache.numel()
