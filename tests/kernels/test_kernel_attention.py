"""Every backend against the float64 reference, over the grid of block sizes, GQA ratios, head dims and dtypes.

The default run takes a representative slice (each block size, GQA ratio, head_dim and dtype appears at
least once); --runslow runs the full product.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from attention_cases import (
    BLOCK_SIZES,
    CPU_DEFAULT,
    DTYPES,
    HEAD_DIMS,
    HEADS,
    decode_lengths,
    expected_decode,
)
from paged_inputs import build_case, skip_unavailable, tolerance

from kvtune.kernels import FP8_DTYPE, paged_decode_attention, paged_prefill_attention
from kvtune.kernels import reference as oracle

BACKENDS = ["cpu", "triton"]

# One row per block size, so that every block size, GQA ratio, head_dim and dtype is covered (fp8 too).
REPRESENTATIVE = [
    (16, (4, 4), 32, torch.float32, None),
    (32, (8, 4), 64, torch.float16, None),
    (64, (8, 2), 128, torch.bfloat16, None),
    (128, (16, 2), 32, torch.bfloat16, FP8_DTYPE),
    (256, (8, 2), 64, torch.float32, FP8_DTYPE),
]


def _marks(backend: str, combo: tuple) -> tuple:
    default = REPRESENTATIVE if backend == "triton" else REPRESENTATIVE + CPU_DEFAULT
    return () if combo in default else (pytest.mark.slow,)


GRID = [
    pytest.param(backend, *combo, marks=_marks(backend, combo))
    for backend in BACKENDS
    for combo in itertools.product(BLOCK_SIZES, HEADS, HEAD_DIMS, DTYPES, [None, FP8_DTYPE])
]
GRID_IDS = "backend,block_size,heads,head_dim,dtype,cache_dtype"


@pytest.mark.parametrize(GRID_IDS, GRID)
def test_decode_matches_float64_reference(backend, block_size, heads, head_dim, dtype, cache_dtype):
    skip_unavailable(backend)
    lengths = decode_lengths(block_size)
    case = build_case(
        lengths, [1] * len(lengths), *heads, head_dim, block_size, dtype, cache_dtype, seed=block_size
    )
    got = case.decode(backend)
    assert got.dtype == dtype and got.shape == case.q.shape
    torch.testing.assert_close(got.double(), expected_decode(case), **tolerance(dtype))


@pytest.mark.parametrize(GRID_IDS, GRID)
def test_prefill_matches_float64_reference(backend, block_size, heads, head_dim, dtype, cache_dtype):
    skip_unavailable(backend)
    # (query_len, seq_len): a whole prompt, a chunk after cached context, one decode-like token, a long chunk.
    pairs = [(19, 19), (5, block_size + 7), (1, 40), (33, 2 * block_size + 1)]
    case = build_case(
        [s for _, s in pairs], [q for q, _ in pairs], *heads, head_dim, block_size, dtype, cache_dtype, seed=7
    )
    args = (case.q, case.kv_cache, case.block_tables, case.query_start_loc, case.seq_lens, case.scale)
    got = paged_prefill_attention(*args, k_scale=case.k_scale, v_scale=case.v_scale, backend=backend)
    expected = oracle.prefill(case.q.double(), *args[1:], case.k_scale, case.v_scale)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_decode_is_exact(backend, num_splits):
    skip_unavailable(backend)
    lengths = [1, 70, 700, 1025]
    case = build_case(lengths, [1] * len(lengths), 8, 2, 64, 16, torch.float32)
    args = (case.q, case.kv_cache, case.block_tables, case.seq_lens, case.scale)
    whole = paged_decode_attention(*args, backend=backend, num_splits=1)
    split = paged_decode_attention(*args, backend=backend, num_splits=num_splits)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(split.double(), expected_decode(case), **tolerance(torch.float32))


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_paged_and_contiguous_layouts_agree(backend):
    """The same K/V behind a scrambled block table and behind the identity table give the same output."""
    skip_unavailable(backend)
    lengths = [100, 257, 31]
    paged = build_case(lengths, [1] * 3, 8, 2, 64, 32, torch.float32, seed=3, scrambled=True)
    contiguous = build_case(lengths, [1] * 3, 8, 2, 64, 32, torch.float32, seed=3, scrambled=False)
    assert not torch.equal(paged.block_tables, contiguous.block_tables)
    outputs = [
        paged_decode_attention(
            c.q, c.kv_cache, c.block_tables, c.seq_lens, c.scale, backend=backend, num_splits=1
        )
        for c in (paged, contiguous)
    ]
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_fp8_cache_stays_within_vllm_fp8_tolerance_of_unquantised(backend):
    """FP8 K/V (scales 0.5 / 0.25) against attention over the original bf16 values: vLLM's 1.5e-1."""
    skip_unavailable(backend)
    lengths = [45, 300]
    fp8 = build_case(lengths, [1, 1], 8, 2, 64, 16, torch.bfloat16, FP8_DTYPE, seed=11)
    exact = build_case(lengths, [1, 1], 8, 2, 64, 16, torch.bfloat16, seed=11)
    torch.testing.assert_close(fp8.q, exact.q)
    got = fp8.decode(backend)
    torch.testing.assert_close(got.double(), expected_decode(exact), atol=1.5e-1, rtol=1.5e-1)


def test_sequences_longer_than_table_are_rejected():
    from kvtune.errors import KvtuneError

    case = build_case([20], [1], 4, 4, 32, 16, torch.float32)
    with pytest.raises(KvtuneError, match="longer than its block table"):
        paged_decode_attention(case.q, case.kv_cache, case.block_tables, case.seq_lens * 10, case.scale)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_fp8_decode_rounds_queries_to_bf16_only_when_they_were_bf16(query_dtype):
    """The cpu backend's bf16 dot-product path (AVX512-BF16 CPUs) rounds queries and softmax weights to
    bf16; with an fp8 cache, float32 and float16 queries must keep their own accuracy against the
    dequantised cache."""
    skip_unavailable("cpu")
    lengths = [1, 37, 300, 1000]
    case = build_case(lengths, [1] * len(lengths), 8, 2, 32, 16, query_dtype, FP8_DTYPE, seed=7)
    got = case.decode("cpu")
    torch.testing.assert_close(got.double(), expected_decode(case), **tolerance(query_dtype))


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_cpu_fp8_decode_widens_every_e4m3_value_exactly(query_dtype):
    """All 256 e4m3 bytes (zeros, subnormals, the largest normals, both NaNs) as the V rows of one-token
    sequences: softmax over one key is 1, so each output is exactly v_scale x the dequantised value. Float32
    queries take the float path's widening; bf16 queries the dot-product path's (byte lookups on AVX512-VBMI)."""
    skip_unavailable("cpu")
    num_kv_heads, head_dim = 2, 32
    num_seqs = 256 // (num_kv_heads * head_dim)
    case = build_case(
        [1] * num_seqs, [1] * num_seqs, 8, num_kv_heads, head_dim, 16, query_dtype, FP8_DTYPE, seed=3
    )
    every_byte = torch.arange(256, dtype=torch.uint8).view(num_seqs, num_kv_heads, head_dim)
    first_blocks = case.block_tables[:, 0].long()
    case.kv_cache.view(torch.uint8)[first_blocks, 1, 0] = every_byte.to(case.kv_cache.device)
    got = case.decode("cpu")
    values = every_byte.view(FP8_DTYPE).float() * case.v_scale  # [seq, kv head, dim]
    expected = values.repeat_interleave(got.shape[1] // num_kv_heads, dim=1).to(got.dtype)
    assert torch.isnan(expected).sum() == 2 * got.shape[1] // num_kv_heads
    torch.testing.assert_close(got.cpu(), expected, atol=0, rtol=0, equal_nan=True)
