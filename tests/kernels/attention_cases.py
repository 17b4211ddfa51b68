"""The attention grid and decode cases the kernel tests share (test_kernel_attention.py, and
test_kernel_isas.py on the narrower CPU builds): the grid's dimensions, the cpu backend's default slice of
it, each block size's decode lengths, and the float64 reference's decode output."""

from __future__ import annotations

import itertools

import torch
from paged_inputs import PagedCase

from kvtune.kernels import FP8_DTYPE
from kvtune.kernels import reference as oracle

BLOCK_SIZES = [16, 32, 64, 128, 256]
HEADS = [(4, 4), (8, 4), (8, 2), (16, 2)]  # GQA ratios 1, 2, 4, 8
HEAD_DIMS = [32, 64, 128]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Every block size x GQA ratio x head_dim for the cpu backend, dtypes and FP8 rotating through them.
CPU_DEFAULT = [
    (*shape, DTYPES[i % len(DTYPES)], FP8_DTYPE if i % 2 else None)
    for i, shape in enumerate(itertools.product(BLOCK_SIZES, HEADS, HEAD_DIMS))
]


def decode_lengths(block_size: int) -> list[int]:
    """1 token, a non-multiple, an exact multiple and a multi-block non-multiple of the block size."""
    return [1, block_size // 2 + 3, 2 * block_size, 3 * block_size + 5]


def expected_decode(case: PagedCase) -> torch.Tensor:
    return oracle.decode(
        case.q.double(),
        case.kv_cache,
        case.block_tables,
        case.seq_lens,
        case.scale,
        case.k_scale,
        case.v_scale,
        None,
    )
