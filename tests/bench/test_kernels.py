"""`kvtune bench kernels` runs end to end on a small batch and records its section in the file it is given."""

from __future__ import annotations

import torch

from kvtune.cli import main


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
