"""Which dtype a checkpoint is served in under `--dtype`, and the reason the boot log gives for it.

`auto` does what vLLM does on a CPU: a float32 checkpoint is served in bfloat16 when the CPU computes
bfloat16 natively (AVX512-BF16), since float32 there only costs speed. Everywhere else `auto` is the
checkpoint's own dtype. The choice is a pure function of the CPU's flags, so it is testable on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvtune.engine.model.model_config import MODEL_DTYPES

BF16_CPU_FLAG = "avx512_bf16"


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype the model and its activations run in, and one line saying why."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature flags, as Linux lists them; empty where there is no /proc/cpuinfo."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def choose_dtype(
    requested: str, checkpoint_dtype: torch.dtype, device_type: str, flags: frozenset[str]
) -> DtypeChoice:
    """The serving dtype for `--dtype requested` (validated by EngineConfig: auto or a MODEL_DTYPES name)."""
    if requested != "auto":
        return DtypeChoice(MODEL_DTYPES[requested], f"--dtype {requested}")
    if device_type == "cpu" and checkpoint_dtype == torch.float32:
        if BF16_CPU_FLAG in flags:
            return DtypeChoice(
                torch.bfloat16,
                "--dtype auto: a float32 checkpoint on a CPU with AVX512-BF16 runs in bfloat16, as vLLM runs it",
            )
        return DtypeChoice(
            torch.float32, "--dtype auto: the checkpoint's float32 (this CPU lacks AVX512-BF16 for bfloat16)"
        )
    return DtypeChoice(checkpoint_dtype, "--dtype auto: the checkpoint's dtype")
