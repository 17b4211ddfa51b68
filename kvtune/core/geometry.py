"""Bytes per token of KV cache, from a model's geometry: the term paging never touches.

This is the one place that prices a token and that says what a block size may be; the kernels, the
engine, the simulator and the peer harness all ask here. It knows dtypes by name and size only (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
MIB = 1024**2

# Element sizes by the names vLLM and kvtune accept for model and KV-cache dtypes.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
}

# The engine's attention kernels tile a block by 16 tokens, so every block size they see is a multiple.
KERNEL_BLOCK_MULTIPLE = 16


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


def dtype_bytes(name: str) -> int:
    """Bytes of one element of the dtype called `name`; ValueError naming the accepted names otherwise."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


def check_block_size(
    block_size: int,
    *,
    multiple_of: int = 1,
    name: str = "block size",
    error: type[Exception] = ValueError,
) -> None:
    """Refuse a block size that is not a positive multiple of `multiple_of` (the kernels need 16).

    Every layer validates with this one rule; `name` and `error` let a caller speak in its own terms
    (a command-line flag, the project's one-line error type).
    """
    if block_size <= 0 or block_size % multiple_of:
        rule = "positive" if multiple_of == 1 else f"a positive multiple of {multiple_of}"
        raise error(f"{name} must be {rule}, got {block_size}")


# The seed's model: Qwen3-8B in bf16, 144 KiB per token.
QWEN3_8B = ModelGeometry(num_layers=36, num_kv_heads=8, head_dim=128, dtype_bytes=2)
