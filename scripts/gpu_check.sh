#!/usr/bin/env bash
# One short GPU session for the paged-attention kernels: the full correctness grid on the device (Triton
# compiled for real, no interpreter), then `kvtune bench kernels`, which records the kernels-gpu section of
# BENCHMARKS.md. Run from the repository root on a machine with CUDA:  bash scripts/gpu_check.sh
# Results land in ${OUT:-gpu-check-out}/ (pytest log, bench table, BENCHMARKS.md copy).
set -euo pipefail

out="${OUT:-gpu-check-out}"
mkdir -p "$out"
python="${PYTHON:-.venv/bin/python}"
if [ ! -x "$python" ]; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet torch==2.13.0 triton==3.7.1 numpy pytest hypothesis pytest-timeout
    .venv/bin/pip install --quiet --no-deps -e .
    python=.venv/bin/python
fi
"$python" - <<'PY'
import torch, triton
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PY
unset TRITON_INTERPRET

# Correctness: every Triton kernel over the full grid (block sizes, GQA ratios, head dims, dtypes, FP8),
# split-K, paged vs contiguous, and the FP8 write against torch's rounding.
"$python" -m pytest tests/kernels -q --runslow -x -k "not cpu" -p no:cacheprovider 2>&1 | tee "$out/pytest.log"

# Speed: copy-bandwidth ceiling, paged vs contiguous vs SDPA, Qwen3-8B geometry, bf16 and FP8.
"$python" -m kvtune.cli bench kernels --skip-cpu --repeats 100 2>&1 | tee "$out/bench.txt"
cp BENCHMARKS.md "$out/BENCHMARKS.md"
