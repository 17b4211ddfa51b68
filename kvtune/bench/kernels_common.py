"""Shared pieces of `kvtune bench kernels`: building a decode batch, bytes read, and the markdown table."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from kvtune.bench.benchmarks_md import git_revision, machine_description
from kvtune.kernels.cache_alloc import allocate_kv_cache


@dataclass(frozen=True)
class DecodeBatch:
    """One layer's decode inputs: a cache holding exactly the batch's blocks, and two tables over it."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    paged_tables: torch.Tensor  # the blocks in scrambled order, as an engine's pool hands them out
    contiguous_tables: torch.Tensor  # the identity: each sequence's blocks back to back
    seq_lens: torch.Tensor
    scale: float

    @property
    def kv_bytes(self) -> int:
        """The bytes a decode step must read: every context token's K and V, all KV heads."""
        num_kv_heads, head_dim = self.kv_cache.shape[3], self.kv_cache.shape[4]
        tokens = int(self.seq_lens.sum())
        return tokens * 2 * num_kv_heads * head_dim * self.kv_cache.element_size()


def make_batch(
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> DecodeBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-length // block_size) for length in seq_lens]
    width, total = max(blocks), sum(blocks)
    identity = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    scrambled = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    order = torch.randperm(total, generator=gen).to(torch.int32)
    start = 0
    for seq, count in enumerate(blocks):
        identity[seq, :count] = torch.arange(start, start + count, dtype=torch.int32)
        scrambled[seq, :count] = order[start : start + count]
        start += count
    cache = allocate_kv_cache(total, block_size, num_kv_heads, head_dim, cache_dtype, device)
    cache.copy_(torch.randn(cache.shape, dtype=dtype, device=device))
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, dtype=dtype, device=device)
    return DecodeBatch(
        q=q,
        kv_cache=cache,
        paged_tables=scrambled.to(device),
        contiguous_tables=identity.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def provenance() -> str:
    """Machine, date, revision, and the load average: other work on the machine lowers every figure."""
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"Machine: {machine_description()}. Date: {today}. Revision: {git_revision()}. torch {torch.__version__}. "
        f"1-minute load average when the run started: {load:.2f}."
    )
