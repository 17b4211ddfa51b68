"""Backend choice and input checks: the engine gets Triton on CUDA, the CPU kernel elsewhere, clear errors."""

from __future__ import annotations

import pytest
import torch
from paged_inputs import build_case

from kvtune.errors import KvtuneError
from kvtune.kernels import paged_decode_attention, select_backend, unavailable_reason


def test_select_backend_by_device():
    assert select_backend("cuda") == "triton"
    assert select_backend(torch.device("cpu")) == (
        "cpu" if unavailable_reason("cpu") is None else "reference"
    )


def test_unknown_backend_is_one_clear_error():
    case = build_case([5], [1], 4, 4, 32, 16, torch.float32)
    with pytest.raises(KvtuneError, match="unknown attention backend 'cuda-graphs'"):
        paged_decode_attention(
            case.q, case.kv_cache, case.block_tables, case.seq_lens, 1.0, backend="cuda-graphs"
        )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: {"kv_cache": c.kv_cache[:, :, :8]}, "multiple of 16"),
        (lambda c: {"q": c.q[:, :3]}, "not a multiple of num_kv_heads"),
        (lambda c: {"q": c.q[..., :16]}, "head_dim"),
        (lambda c: {"seq_lens": c.seq_lens.long()}, "int32"),
        (lambda c: {"block_tables": c.block_tables.long()}, "int32"),
        (lambda c: {"seq_lens": c.seq_lens * 0}, "at least one token"),
    ],
)
def test_bad_inputs_raise_kvtune_error(mutate, message):
    case = build_case([5, 9], [1, 1], 4, 4, 32, 16, torch.float32)
    args = {
        "q": case.q,
        "kv_cache": case.kv_cache,
        "block_tables": case.block_tables,
        "seq_lens": case.seq_lens,
    }
    args.update(mutate(case))
    with pytest.raises(KvtuneError, match=message):
        paged_decode_attention(**args, scale=1.0, backend="reference")
