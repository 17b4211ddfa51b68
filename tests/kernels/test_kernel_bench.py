"""`kvtune bench kernels` runs end to end on a small batch and records its section in the file it is given."""

from __future__ import annotations

import torch

from kvtune.cli import main
from kvtune.kernels.cache_alloc import allocate_kv_cache


def test_bench_kernels_prints_and_records_a_cpu_section(tmp_path, capsys):
    output = tmp_path / "BENCHMARKS.md"
    args = [
        "bench",
        "kernels",
        "--batch",
        "3",
        "--min-context",
        "20",
        "--max-context",
        "40",
        "--repeats",
        "1",
    ]
    assert main([*args, "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert "reductions before each case" in printed and "| cpu | bf16 | 32 |" in printed
    assert "| read-only | bf16 | 32 |" in printed
    if not torch.cuda.is_available():
        assert "no CUDA device" in printed
    text = output.read_text()
    assert "<!-- kvtune:kernels-cpu:begin -->" in text and "of ceiling" in text


def test_bench_rejects_bad_flags(capsys):
    assert main(["bench", "kernels", "--min-context", "50", "--max-context", "10", "--no-record"]) == 2
    assert "min-context" in capsys.readouterr().err


def test_allocated_cache_has_the_paged_layout():
    cache = allocate_kv_cache(7, 16, 2, 32, torch.bfloat16)
    assert cache.shape == (7, 2, 16, 2, 32) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    cache.fill_(1.5)
    assert float(cache.float().sum()) == 1.5 * cache.numel()
