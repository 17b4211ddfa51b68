"""Every CPU kernel build this machine can run, against the float64 reference.

The engine loads the native build (`-march=native`); the `avx2` variant is the same source with AVX-512
switched off, the code an AVX2-only CPU runs (8-lane decode and prefill runners). An AVX-512 machine runs
both, so both are tested here; a variant whose instructions the CPU lacks is skipped, with the reason, never
passed. test_kernel_attention.py runs the whole grid on the native build; here every other variant runs its
default slice, and every variant the tiled prefill's own cases (several tiles and key chunks, cached context,
query-head groups that do not divide the tile).
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import CPU_DEFAULT, decode_lengths, expected_decode
from paged_inputs import build_case, skip_unavailable, tolerance

from kvtune.errors import KvtuneError
from kvtune.kernels import paged_prefill_attention
from kvtune.kernels import reference as oracle
from kvtune.kernels.cpu_build import ISA_ENV, ISA_FLAGS, runnable_isas, selected_isa

NARROWER = [isa for isa in ISA_FLAGS if isa != "native"]


@pytest.fixture
def use_isa(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def select(isa: str) -> None:
        if isa not in runnable_isas():
            pytest.skip(f"not run: this CPU lacks the instructions of the {isa} build")
        monkeypatch.setenv(ISA_ENV, isa)
        skip_unavailable("cpu")

    return select


@pytest.mark.parametrize("isa", NARROWER)
@pytest.mark.parametrize("combo", CPU_DEFAULT, ids=str)
def test_narrower_builds_decode_and_prefill_match_float64_reference(use_isa, isa, combo) -> None:
    use_isa(isa)
    block_size, heads, head_dim, dtype, cache_dtype = combo
    lengths = decode_lengths(block_size)
    case = build_case(
        lengths, [1] * len(lengths), *heads, head_dim, block_size, dtype, cache_dtype, seed=block_size
    )
    got = case.decode("cpu")
    torch.testing.assert_close(got.double(), expected_decode(case), **tolerance(dtype))
    pairs = [(19, 19), (5, block_size + 7), (1, 40), (33, 2 * block_size + 1)]
    case = build_case(
        [s for _, s in pairs], [q for q, _ in pairs], *heads, head_dim, block_size, dtype, cache_dtype, seed=7
    )
    args = (case.q, case.kv_cache, case.block_tables, case.query_start_loc, case.seq_lens, case.scale)
    got = paged_prefill_attention(*args, k_scale=case.k_scale, v_scale=case.v_scale, backend="cpu")
    expected = oracle.prefill(case.q.double(), *args[1:], case.k_scale, case.v_scale)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))


# (q heads, kv heads, head_dim): groups 1, 3 (21 tokens a tile, one padding row), 4, 8 and 16.
PREFILL_SHAPES = [(4, 4, 32), (12, 4, 64), (8, 2, 32), (16, 2, 128), (32, 2, 64)]


@pytest.mark.parametrize("isa", list(ISA_FLAGS))
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiled_prefill_over_many_tiles_and_chunks(use_isa, isa, shape, dtype) -> None:
    """Whole prompts, a chunk after a long cached context (recompute), and a chunk ending mid-block: several
    query tiles, key chunks before the causal diagonal (unmasked) and on it (masked)."""
    use_isa(isa)
    num_q_heads, num_kv_heads, head_dim = shape
    pairs = [(300, 300), (150, 700), (70, 199), (1, 65)]
    case = build_case(
        [s for _, s in pairs], [q for q, _ in pairs], num_q_heads, num_kv_heads, head_dim, 32, dtype, seed=5
    )
    args = (case.q, case.kv_cache, case.block_tables, case.query_start_loc, case.seq_lens, case.scale)
    got = paged_prefill_attention(*args, backend="cpu")
    expected = oracle.prefill(case.q.double(), *args[1:], case.k_scale, case.v_scale)
    torch.testing.assert_close(got.double(), expected, **tolerance(dtype))


def test_an_unknown_isa_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_ENV, "avx9")
    with pytest.raises(
        KvtuneError, match=r"KVTUNE_CPU_ISA='avx9' is not a kernel build; choose one of native"
    ):
        selected_isa()


def test_native_is_always_runnable_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert selected_isa() == "native"
    assert "native" in runnable_isas()
