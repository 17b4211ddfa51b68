"""A decoder layer's small ops fused in C++ for the CPU (csrc/model_ops_cpu.cpp): RMSNorm with the residual
add before it, RoPE with the KV-cache write, and SiLU-and-multiply.

Why: in the live profile of the tiny model on a 2-core AVX-512 EPYC, the ops between the matmuls and the
attention kernel (norms, RoPE, SiLU, residual adds, casts, each a torch call) took 15% of the engine thread,
and 102 ms of a 635 ms prefill step; each op is a dispatch and a pass over memory. Here each group is one
call and one pass. What they compute (see the .cpp): the adds, the rotation and the products exactly as the
model's torch code rounds them; the norm's sum of squares in another order than torch's reduction, and
silu's exp by libm rather than torch's, so those two match torch to float32 rounding (for bfloat16: at most
one bfloat16 unit in the last place, on rare elements), which tests/kernels/test_model_ops.py checks.

`fused_ops(device, dtype)` is resolved once, at model load: None where the ops cannot run (not a CPU tensor,
a dtype other than float32/bfloat16, no compiler), and the model keeps its torch code there.
"""

from __future__ import annotations

import ctypes

import torch

from kvtune.errors import KvtuneError
from kvtune.kernels.cpu_build import MODEL_OPS_SOURCE, load

_DTYPES = {torch.float32: 0, torch.bfloat16: 2}
# Elements an op must touch before it is split over the step's torch threads (which the linears around it have
# just woken). On an AMX Xeon at 2 threads, split: SiLU-and-multiply of 32 rows 0.074 -> 0.040 ms, of 2,048
# rows 4.8 -> 2.5 ms; below ~16K elements (a few rows) one thread is as fast.
PARALLEL_MIN_ELEMENTS = 1 << 14


def _threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= PARALLEL_MIN_ELEMENTS else 1


def _pointer(tensor: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if tensor is None else tensor.data_ptr())


class FusedOps:
    """The fused ops for one model dtype; inputs must be contiguous CPU tensors of that dtype."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._code = _DTYPES[dtype]
        self._norm = library.kvt_add_rms_norm
        self._norm.argtypes = [ctypes.c_void_p] * 5 + [
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_int,
        ]
        self._rope = library.kvt_rope_write
        self._rope.argtypes = (
            [ctypes.c_void_p] * 6
            + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            + [ctypes.c_int64] * 3
            + [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        )
        self._silu = library.kvt_silu_mul
        self._silu.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
        ]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * RMSNorm(x) over the last dim."""
        out = torch.empty_like(x)
        cols = x.shape[-1]
        self._norm(
            _pointer(x), None, _pointer(weight), None, _pointer(out), x.numel() // cols, cols, eps, self._code,
            _threads(x.numel()),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, weight * RMSNorm(x + delta)): the residual stream and the next sublayer's input."""
        total, out = torch.empty_like(x), torch.empty_like(x)
        cols = x.shape[-1]
        self._norm(
            _pointer(x), _pointer(delta), _pointer(weight), _pointer(total), _pointer(out),
            x.numel() // cols, cols, eps, self._code, _threads(x.numel()),
        )  # fmt: skip
        return total, out

    def rope_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        layer_cache: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> torch.Tensor:
        """q `[tokens, num_heads, head_dim]` rotated; k rotated and v written to their slots of `layer_cache`
        (`[blocks, 2, block_size, kv_heads, head_dim]`, contiguous, the model dtype); slots < 0 are skipped."""
        tokens = qkv.shape[0]
        q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype)
        self._rope(
            _pointer(qkv), _pointer(cos), _pointer(sin), _pointer(slot_mapping), _pointer(layer_cache), _pointer(q),
            tokens, num_heads, num_kv_heads, head_dim,
            layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.shape[2], self._code,
            _threads(qkv.numel()),
        )  # fmt: skip
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, the two halves of the last dim of `gate_up`."""
        width = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype)
        self._silu(
            _pointer(gate_up), _pointer(out), gate_up.numel() // (2 * width), width, self._code,
            _threads(gate_up.numel()),
        )  # fmt: skip
        return out

    def fits_cache(self, layer_cache: torch.Tensor) -> bool:
        """Whether rope_write can write this cache: the model dtype (no FP8 scaling), contiguous."""
        return layer_cache.dtype == self.dtype and layer_cache.is_contiguous()


def fused_ops(device: torch.device | str, dtype: torch.dtype) -> FusedOps | None:
    """The fused ops for a model in `dtype` on `device`, or None where they cannot run (see the docstring)."""
    if torch.device(device).type != "cpu" or dtype not in _DTYPES:
        return None
    try:
        library = load(MODEL_OPS_SOURCE)
    except KvtuneError:
        return None
    return FusedOps(library, dtype)
