"""`--dtype auto` serves a float32 checkpoint in bfloat16 on a CPU with AVX512-BF16, as vLLM does, and
otherwise the checkpoint's dtype; the decision is a pure function of the CPU's flags, tested here on a
machine that may lack them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtune.engine.model.engine_config import EngineConfig
from kvtune.engine.model.serving_dtype import choose_dtype, cpu_flags
from kvtune.errors import KvtuneError

BF16_CPU = frozenset({"avx2", "avx512f", "avx512_bf16"})
ZNVER3 = frozenset({"avx2", "fma", "sha_ni"})


@pytest.mark.parametrize(
    ("checkpoint", "device", "flags", "served"),
    [
        (torch.float32, "cpu", BF16_CPU, torch.bfloat16),
        (torch.float32, "cpu", ZNVER3, torch.float32),
        (torch.bfloat16, "cpu", BF16_CPU, torch.bfloat16),
        (torch.float16, "cpu", BF16_CPU, torch.float16),
        (torch.float32, "cuda", BF16_CPU, torch.float32),
    ],
)
def test_auto_follows_vllm_on_cpus(
    checkpoint: torch.dtype, device: str, flags: frozenset[str], served: torch.dtype
) -> None:
    choice = choose_dtype("auto", checkpoint, device, flags)
    assert choice.dtype == served
    assert choice.reason.startswith("--dtype auto") and "\n" not in choice.reason


def test_the_reason_names_the_cpu_feature() -> None:
    assert "AVX512-BF16" in choose_dtype("auto", torch.float32, "cpu", BF16_CPU).reason
    assert "lacks AVX512-BF16" in choose_dtype("auto", torch.float32, "cpu", ZNVER3).reason


def test_an_explicit_dtype_wins_whatever_the_cpu() -> None:
    choice = choose_dtype("float32", torch.float32, "cpu", BF16_CPU)
    assert choice.dtype == torch.float32 and choice.name == "float32" and choice.reason == "--dtype float32"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: x\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t\t: none\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "absent") == frozenset()


def test_an_unknown_dtype_is_one_clear_error() -> None:
    with pytest.raises(KvtuneError, match="--dtype must be auto, float32, float16, bfloat16"):
        EngineConfig(model="m", dtype="float64").validate()
