"""Random paged-attention inputs built the way an engine lays them out, with traps for out-of-bounds reads.

Blocks are handed out in a scrambled order from a pool larger than needed; every slot that no token was
written to (unused blocks and the tail of each last block) holds NaN, and unused block-table entries point
at NaN blocks, so a kernel that reads one token too far returns NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvtune.kernels import paged_decode_attention, unavailable_reason
from kvtune.kernels.cache_dtype import FP8_DTYPE
from kvtune.kernels.write import write_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def skip_unavailable(backend: str) -> None:
    """Skip the calling test when `backend` cannot run here (or, for the cpu backend, tensors are on a GPU)."""
    reason = unavailable_reason(backend)
    if reason is not None:
        pytest.skip(reason)
    if backend == "cpu" and DEVICE.type != "cpu":
        pytest.skip("the cpu backend runs on cpu tensors")


@dataclass
class PagedCase:
    q: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, [seq_len, Hkv, D], before quantisation
    values: list[torch.Tensor]
    scale: float
    k_scale: float
    v_scale: float

    def decode(self, backend: str) -> torch.Tensor:
        """paged_decode_attention of this case on `backend`, with its scales: the one call every decode
        check makes."""
        return paged_decode_attention(
            self.q, self.kv_cache, self.block_tables, self.seq_lens, self.scale,
            k_scale=self.k_scale, v_scale=self.v_scale, backend=backend,
        )  # fmt: skip


def build_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    *,
    seed: int = 0,
    scrambled: bool = True,
    spare_blocks: int = 3,
) -> PagedCase:
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    shuffled = torch.randperm(num_blocks, generator=gen)  # drawn either way so both layouts get equal data
    order = shuffled if scrambled else torch.arange(num_blocks)
    width = max(needed) + 1
    tables = torch.empty(len(seq_lens), width, dtype=torch.int32)
    spare = order[sum(needed) :]
    taken = 0
    for seq, count in enumerate(needed):
        tables[seq, :count] = order[taken : taken + count].to(torch.int32)
        tables[seq, count:] = spare[torch.randint(0, spare_blocks, (width - count,), generator=gen)].to(
            torch.int32
        )
        taken += count
    fp8 = cache_dtype == FP8_DTYPE
    k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan")).to(cache_dtype)
    keys, values = [], []
    for seq, length in enumerate(seq_lens):
        key = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        value = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        positions = torch.arange(length)
        slots = tables[seq, positions // block_size].long() * block_size + positions % block_size
        write_kv(cache, key, value, slots, k_scale, v_scale)
        keys.append(key)
        values.append(value)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    q = torch.randn(int(starts[-1]), num_q_heads, head_dim, generator=gen).to(dtype)
    return PagedCase(
        q=q.to(DEVICE),
        kv_cache=cache.to(DEVICE),
        block_tables=tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=starts.to(DEVICE),
        keys=keys,
        values=values,
        scale=head_dim**-0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """vLLM's tolerances per activation dtype (bf16 1.5e-2 / 1e-2); float32 is checked much tighter."""
    return {
        torch.float32: {"atol": 2e-5, "rtol": 2e-5},
        torch.float16: {"atol": 2e-3, "rtol": 2e-3},
        torch.bfloat16: {"atol": 1.5e-2, "rtol": 1e-2},
    }[dtype]
