"""Compile the CPU kernel (csrc/paged_attention_cpu.cpp) once per machine and load it with ctypes; the
benchmark probes are built the same way from their own source, with `build(source)`.

Why a plain C++ library, measured on the 2-core EPYC VM this was written on (fp32, tiny-model geometry,
batch 64, contexts 300-1800, block 16, 2 threads, caches far larger than L3):
- this kernel: about 2.6-2.8 ms per layer, builds in about 3 s with the system compiler;
- a straightforward numba version (prange over sequences, fastmath): 5.4 ms, 2 s JIT per signature, and
  numba has no bf16 or fp8 types, so those caches would need bit tricks in Python-level code;
- a torch C++ extension: the same code could live there, but a trivial `load_inline` took 29 s to build
  (torch's headers), which every fresh CI machine would pay.
GCC vector extensions (`vector_size`, `__builtin_shuffle`, so GCC is needed) give explicit 16-lane code
that compiles to AVX-512 here and to narrower vectors elsewhere. On top of that, `-march=native` switches on
AVX-512 intrinsics where the CPU has them, each behind an `#if` with a portable fallback: AVX512F for
broadcasts and exp; AVX512-BF16 (with F and BW) for bf16 dot products (`vdpbf16ps`) on bf16 and fp8 caches,
which AVX512-VBMI speeds up further for fp8 with a byte-permute conversion; without AVX512-BF16 those caches
take the vector-extension path.
The library is cached under ~/.cache/kvtune (or $KVTUNE_CACHE_DIR), keyed by the source, the flags, the
compiler and the CPU, and written atomically so concurrent first uses cannot load a half-written file.
`python -m kvtune.kernels.cpu_build` builds it ahead of time.

Builds narrower than the CPU (ISA variants): `avx2` compiles with AVX-512 switched off, so an AVX-512 machine
builds, tests and times the code an AVX2-only CPU runs. $KVTUNE_CPU_ISA picks the variant the engine loads
(default `native`); the tests run every variant the CPU can execute.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from kvtune.errors import KvtuneError

# The kernel's headers (cpu_primitives.h and one per runner, each compiling alone) and paged_attention_common.h,
# which the benchmark's probes include too; every header is part of a build's cache key.
INCLUDE_DIR = Path(__file__).parent / "csrc"
SOURCE = INCLUDE_DIR / "paged_attention_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
MODEL_OPS_SOURCE = INCLUDE_DIR / "model_ops_cpu.cpp"
# Flags of one source only: the model's fused ops must round each product and sum as torch does (no fused
# multiply-add), and their plain loops are vectorised at the CPU's full width (GCC stops at 256 bits on Intel
# unless asked: silu-and-multiply of a 2,048-token chunk took 6.9 ms at 256 bits, 4.8 ms at 512 on an AMX Xeon).
SOURCE_FLAGS: dict[str, tuple[str, ...]] = {
    MODEL_OPS_SOURCE.name: ("-ffp-contract=off", "-mprefer-vector-width=512")
}
# Extra flags of each ISA variant, and the CPU flags (as /proc/cpuinfo names them) it needs to run.
ISA_FLAGS: dict[str, tuple[str, ...]] = {"native": (), "avx2": ("-mno-avx512f",)}
ISA_NEEDS: dict[str, frozenset[str]] = {"native": frozenset(), "avx2": frozenset({"avx2", "fma"})}
ISA_ENV = "KVTUNE_CPU_ISA"


def _compiler() -> str:
    found = shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")
    if found is None:
        raise KvtuneError("the cpu attention backend needs GCC's C++ compiler (g++, or set $CXX)")
    return found


def _cache_dir() -> Path:
    root = os.environ.get("KVTUNE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvtune")
    return Path(root) / "kernels"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (empty without /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def selected_isa() -> str:
    """The variant the engine loads: $KVTUNE_CPU_ISA, or `native`."""
    isa = os.environ.get(ISA_ENV) or "native"
    if isa not in ISA_FLAGS:
        raise KvtuneError(f"${ISA_ENV}={isa!r} is not a kernel build; choose one of {', '.join(ISA_FLAGS)}")
    return isa


def runnable_isas() -> list[str]:
    """The variants this CPU can execute (every one whose instructions it has)."""
    flags = _cpu_flags()
    return [isa for isa, needs in ISA_NEEDS.items() if needs <= flags]


def _flags(source: Path, isa: str) -> tuple[str, ...]:
    return (*FLAGS, *SOURCE_FLAGS.get(source.name, ()), *ISA_FLAGS[isa])


def library_path(compiler: str, source: Path = SOURCE, isa: str = "native") -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    headers = [header.read_text() for header in sorted(INCLUDE_DIR.glob("*.h"))]
    flags = " ".join(_flags(source, isa))
    key = hashlib.sha256(
        "\n".join([source.read_text(), *headers, flags, version, _cpu_model()]).encode()
    ).hexdigest()[:16]
    suffix = "" if isa == "native" else f"-{isa}"
    return _cache_dir() / f"{source.stem}{suffix}-{key}.so"


def build(source: Path = SOURCE, isa: str = "native") -> Path:
    """Compile `source` (the kernel by default; the benchmark's probes reuse this with theirs) for ISA
    variant `isa` unless a build for this source, its headers, flags, compiler and CPU is cached; return the
    library's path."""
    compiler = _compiler()
    target = library_path(compiler, source, isa)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *_flags(source, isa), f"-I{INCLUDE_DIR}", str(source), "-o", str(partial)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["no output"])[0]
            raise KvtuneError(f"building {source.name} failed: {first}")
        partial.replace(target)
    return target


@cache
def load(source: Path = SOURCE, isa: str = "native") -> ctypes.CDLL:
    """Build if needed and load the library of `source` for ISA variant `isa` (once per process)."""
    return ctypes.CDLL(str(build(source, isa)))


def build_all(sources: list[Path]) -> list[Path]:
    """Build several libraries at once (one compiler each), so a fresh machine waits for the longest only:
    each source natively, and the kernel also as every narrower variant this CPU runs (its tests use them)."""
    jobs = [(source, "native") for source in sources]
    if SOURCE.resolve() in {source.resolve() for source in sources}:
        jobs += [(SOURCE, isa) for isa in runnable_isas() if isa != "native"]
    with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        return list(pool.map(lambda job: build(*job), jobs))


if __name__ == "__main__":
    # `python kvtune/kernels/cpu_build.py [SOURCE ...]` needs neither torch nor an installed kvtune (only the
    # standard library and kvtune.errors), so `make` runs it while pip installs the rest.
    for built in build_all([Path(arg) for arg in sys.argv[1:]] or [SOURCE]):
        print(built)
