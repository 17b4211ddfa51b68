"""Compile the CPU kernel (csrc/paged_attention_cpu.cpp) once per machine and load it with ctypes.

Why a plain C++ library and not numba or a torch extension (measured on a 2-core EPYC, see BENCHMARKS.md):
it builds in about 3 s with the system compiler (a torch C++ extension needs torch's headers and takes
about a minute per build, too slow for a fresh CI machine), needs no extra package, and OpenMP SIMD pragmas
plus `-march=native` give vectorised bf16/fp8 conversion and exp that numba does not offer for bf16 and fp8.
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
    found = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if found is None:
        raise KvtuneError("the cpu attention backend needs a C++ compiler (c++ or g++, or set $CXX)")
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
