"""Record benchmark tables in BENCHMARKS.md.

Each benchmark command owns one section, fenced by HTML comments, and rewrites only that section, so
several commands can keep their latest figures in one file without clobbering each other.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

HEADER = (
    "# Benchmarks\n\nEvery table below is written by the command named in its section; rerun it to refresh.\n"
)


def vector_isa(flags: set[str]) -> str:
    """The vector extensions that decide CPU figures here, in words: the kernel's width (AVX2 or AVX-512),
    native bf16 dot products (AVX512-BF16) and AMX tiles, which oneDNN's bf16 GEMMs (vLLM's) take. The same
    model name is sold with and without AVX-512, so the name alone does not say which figures apply."""
    amx = "AMX" if "amx_bf16" in flags or "amx_tile" in flags else "no AMX"
    if "avx512f" in flags:
        bf16 = "with AVX512-BF16" if "avx512_bf16" in flags else "without native bf16"
        return f"AVX-512 {bf16}, {amx}"
    return f"AVX2, no AVX-512, {amx}" if "avx2" in flags else f"no AVX2, {amx}"


def machine_description() -> str:
    """A one-line description of the machine a benchmark ran on (CPU model and vector ISA, cores, Python)."""
    import os

    from kvtune.engine.model.serving_dtype import cpu_flags

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    isa = f" ({vector_isa(set(flags))})" if flags else ""
    return f"{cpu}{isa}, {os.cpu_count()} cores, Python {platform.python_version()}"


def git_revision(repo: Path | None = None) -> str:
    """The short commit the benchmark ran on, or 'unknown' outside a checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=repo,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record_section(name: str, body: str, path: Path = Path("BENCHMARKS.md")) -> None:
    """Replace (or append) the section called `name` in `path` with `body` (markdown)."""
    begin, end = f"<!-- kvtune:{name}:begin -->", f"<!-- kvtune:{name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail.lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)
