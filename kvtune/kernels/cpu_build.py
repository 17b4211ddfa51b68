"""Compile the CPU kernel (csrc/paged_attention_cpu.cpp) once per machine and load it with ctypes.

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
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from kvtune.errors import KvtuneError

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


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


def library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_model()]).encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"paged_attention_cpu-{key}.so"


def build() -> Path:
    """Compile the library unless a build for this source, compiler and CPU is cached; return its path."""
    compiler = _compiler()
    target = library_path(compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(partial)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["no output"])[0]
            raise KvtuneError(f"building the cpu attention kernel failed: {first}")
        partial.replace(target)
    return target


@cache
def load() -> ctypes.CDLL:
    """Build if needed and load the library (once per process)."""
    return ctypes.CDLL(str(build()))


if __name__ == "__main__":
    print(build())
