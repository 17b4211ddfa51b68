"""The machine line every recorded benchmark carries names the vector ISA: CPU figures here hinge on it (the
decode kernel's width, bf16 GEMMs native or emulated), and one model name is sold with and without AVX-512."""

from __future__ import annotations

import os
from pathlib import Path

from kvtune.bench.benchmarks_md import machine_description, vector_isa


def test_vector_isa_names_what_decides_the_figures() -> None:
    assert vector_isa({"sse2", "avx", "avx2", "fma"}) == "AVX2, no AVX-512, no AMX"
    assert vector_isa({"avx2", "avx512f", "avx512bw"}) == "AVX-512 without native bf16, no AMX"
    assert vector_isa({"avx2", "avx512f", "avx512_bf16"}) == "AVX-512 with AVX512-BF16, no AMX"
    amx = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert vector_isa(amx) == "AVX-512 with AVX512-BF16, AMX"
    assert vector_isa({"sse2"}) == "no AVX2, no AMX"


def test_machine_description_reads_this_machine() -> None:
    line = machine_description()
    assert f", {os.cpu_count()} cores, Python " in line
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = set(next(ln for ln in cpuinfo.splitlines() if ln.startswith("flags")).split(":", 1)[1].split())
    assert f"({vector_isa(flags)})" in line
