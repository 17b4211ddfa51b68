"""What every Triton kernel launcher needs: interpreter detection, dot dtypes and launch sizes.

Under TRITON_INTERPRET=1 (the CPU tests) bf16 arithmetic and bf16 dots are wrong, so kernels convert every
load to float32 at once and, when interpreted, also run their dots in float32; on a GPU the dots of a
bf16/fp16 model take that dtype on purpose so they run on tensor cores.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(activation: torch.dtype) -> tl.dtype:
    """float32 when interpreted or for float32 models (IEEE, not TF32), else the model's 16-bit dtype."""
    if interpreted() or activation == torch.float32:
        return tl.float32
    return _TL_DTYPES[activation]


def dot_precision(activation: torch.dtype) -> str:
    """IEEE for float32 dots (GPU default is TF32, too coarse for float32 models); 16-bit dots ignore it."""
    return "ieee" if dot_dtype(activation) == tl.float32 else "tf32"


def padded(n: int, minimum: int = 16) -> int:
    """The power of two ≥ n and ≥ minimum (tl.dot needs every dimension ≥ 16)."""
    return max(minimum, int(triton.next_power_of_2(n)))
