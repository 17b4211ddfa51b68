"""The paged KV cache in tensors: one `[num_blocks, 2, block_size, num_kv_heads, head_dim]` tensor per layer.

Block ids are shared by all layers: block b of every layer holds the same tokens, so the block pool of
kvtune.core hands out ids and this class never tracks ownership. The pool is sized by tokens or by bytes,
and an FP8 cache holds twice the tokens of a 16-bit one in the same bytes.
"""

from __future__ import annotations

import torch

from kvtune.core.geometry import KERNEL_BLOCK_MULTIPLE, check_block_size
from kvtune.engine.model.model_config import ModelConfig
from kvtune.errors import KvtuneError
from kvtune.kernels import cache_dtype_name, kv_bytes_per_token, resolve_cache_dtype
from kvtune.kernels.cache_alloc import allocate_kv_cache


class KVCache:
    """Per-layer cache tensors and the per-tensor FP8 scales the kernels dequantise with."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1:
            raise KvtuneError("the KV cache needs at least one block")
        check_block_size(block_size, multiple_of=KERNEL_BLOCK_MULTIPLE, error=KvtuneError)
        # Uninitialised (huge pages on the CPU): the kernels read only slots that write_kv has filled.
        self.layers = [
            allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
            for _ in range(num_layers)
        ]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def num_tokens(self) -> int:
        """Token slots in the pool: what vLLM logs as `KV cache size: N tokens`."""
        return self.num_blocks * self.block_size

    @property
    def dtype_name(self) -> str:
        """The `cache_dtype` label of `vllm:cache_config_info`."""
        return cache_dtype_name(self.dtype)

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        block_size: int,
        *,
        num_tokens: int | None = None,
        memory_bytes: int | None = None,
        cache_dtype: str = "auto",
        model_dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """A cache for `config` holding `num_tokens` slots or fitting in `memory_bytes` (exactly one given),
        rounded down to whole blocks. `cache_dtype` is `auto` (the model's dtype), `fp8`, `bf16`, ..."""
        if (num_tokens is None) == (memory_bytes is None):
            raise KvtuneError("size the KV cache by tokens or by bytes, not both or neither")
        dtype = resolve_cache_dtype(cache_dtype, model_dtype or config.dtype)
        if num_tokens is not None:
            num_blocks = num_tokens // block_size
        else:
            assert memory_bytes is not None
            per_token = kv_bytes_per_token(dtype, config.num_kv_heads, config.head_dim, config.num_layers)
            num_blocks = memory_bytes // (per_token * block_size)
        if num_blocks < 1:
            raise KvtuneError(f"the KV cache budget holds less than one block of {block_size} tokens")
        return cls(
            config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device
        )
