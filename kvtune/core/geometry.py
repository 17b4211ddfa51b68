"""Bytes per token of KV cache, from a model's geometry: the term paging never touches."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class ModelGeometry:
    """Layers × KV heads × head_dim × dtype bytes × 2 (K and V) is what one token costs in the pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def tokens_in(self, pool_bytes: float) -> int:
        """How many token slots a pool of `pool_bytes` holds."""
        return int(pool_bytes // self.bytes_per_token)


# The seed's model: Qwen3-8B in bf16, 144 KiB per token.
QWEN3_8B = ModelGeometry(num_layers=36, num_kv_heads=8, head_dim=128, dtype_bytes=2)
