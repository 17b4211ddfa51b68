"""bfloat16 linear layers on a CPU that has no bfloat16 arithmetic, computed the way a bfloat16 GEMM is
defined, at float32 GEMM speed.

A bfloat16 GEMM multiplies bfloat16 inputs by bfloat16 weights, accumulates in float32 and rounds the result
to bfloat16. On a CPU without AVX512-BF16 (or AMX), oneDNN emulates that and runs about 7x slower than a
float32 GEMM of the same shape (measured on an AVX2 EPYC: 12 against 90 GFLOPS at 64 x 256 x 768). Widening
a bfloat16 number to float32 is exact, so a float32 GEMM over the widened weights and the widened input,
rounded back to bfloat16, computes the same products with the same float32 accumulation: the layer stays a
bfloat16 layer (bfloat16 in, bfloat16 out, the same weights' values), only faster. The cost is memory: the
weights are held as float32, twice their bfloat16 size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvtune.engine.model.serving_dtype import BF16_CPU_FLAG

NATIVE_BF16_FLAGS = frozenset({BF16_CPU_FLAG, "amx_bf16"})


def widening_pays(device_type: str, dtype: torch.dtype, flags: frozenset[str]) -> bool:
    """Only bfloat16 on a CPU that lacks native bfloat16 arithmetic: elsewhere the native GEMM is faster."""
    return device_type == "cpu" and dtype == torch.bfloat16 and not flags & NATIVE_BF16_FLAGS


class WidenedLinear(nn.Module):
    """A bfloat16 `nn.Linear` whose weights are held widened to float32; input and output stay bfloat16."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = (
            None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(self.out_dtype)


def replace_bf16_linears(model: nn.Module, wrap: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every bfloat16 `nn.Linear` inside `model` by `wrap(linear)`; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, wrap(child))
                replaced += 1
    return replaced


def widen_bf16_linears(model: nn.Module) -> int:
    """Replace every bfloat16 `nn.Linear` inside `model` by a WidenedLinear; returns how many were replaced."""
    return replace_bf16_linears(model, WidenedLinear)
