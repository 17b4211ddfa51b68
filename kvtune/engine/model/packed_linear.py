"""bfloat16 linear layers on a CPU with native bfloat16 arithmetic (AVX512-BF16, AMX): oneDNN's GEMM over
weights reordered once, at load, into its blocked layout.

`F.linear` on bfloat16 CPU tensors already runs oneDNN's GEMM, but from the plain weight, which it reorders on
every call; prepacking does that once (as inductor's freezing and vLLM's CPU build do). The GEMM kernel and
its accumulation are the same, so the outputs are bitwise those of `F.linear` (tests/engine/test_packed_linear.py
checks it); only the per-call reorder goes. Measured on an AVX-512 EPYC with AVX512-BF16, one thread: 10-30%
off the tiny model's projections, and 2-4x off large weights at a few rows (1 x 1024 x 6144: 2.2 -> 0.6 ms).
float32 is left alone: there the packed path sums in another order than MKL's GEMM (not bitwise) and is not
reliably faster at these shapes.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtune.engine.model.widened_linear import NATIVE_BF16_FLAGS, replace_bf16_linears

# Rows the reordered layout is chosen for: a decode batch (the layout serves any row count).
_BATCH_HINT = 64


def packing_pays(device_type: str, dtype: torch.dtype, flags: frozenset[str]) -> bool:
    """bfloat16 on a CPU with native bfloat16 arithmetic, where torch's oneDNN backend is built in."""
    return (
        device_type == "cpu"
        and dtype == torch.bfloat16
        and bool(flags & NATIVE_BF16_FLAGS)
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    )


class PackedLinear(nn.Module):
    """A bfloat16 `nn.Linear` whose weight is held in oneDNN's blocked layout; input and output bfloat16."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            rows, self.packed_weight, self.bias, "none", [], ""
        )
        return out.view(*x.shape[:-1], self.out_features)


def pack_bf16_linears(model: nn.Module) -> int:
    """Replace every bfloat16 `nn.Linear` inside `model` by a PackedLinear; returns how many were replaced."""
    return replace_bf16_linears(model, PackedLinear)
