"""The Triton backend (GPU; on a CPU only under TRITON_INTERPRET=1, which the tests use)."""

from __future__ import annotations

from kvtune.kernels.triton_common import interpreted
from kvtune.kernels.triton_decode import decode
from kvtune.kernels.triton_prefill import prefill
from kvtune.kernels.triton_write import write_kv

__all__ = ["available", "decode", "prefill", "write_kv"]


def available() -> str | None:
    import torch

    if torch.cuda.is_available() or interpreted():
        return None
    return "triton needs a CUDA device (or TRITON_INTERPRET=1 to run interpreted on the CPU)"
