#!/usr/bin/env bash
# One short GPU session for the paged-attention kernels, run from the repository root on a CUDA machine:
#   bash scripts/gpu_check.sh
# 1. the representative correctness grid (what `make test` runs in the Triton interpreter), compiled for real;
# 2. `kvtune bench kernels --skip-cpu` (kvtune/bench/kernels_gpu.py), which records the kernels-gpu section of
#    BENCHMARKS.md;
# 3. the full grid (--runslow), while time is left.
# The order puts the cheapest decisive check first: a lent machine's minutes are few, and a late step that
# runs out of time still leaves the earlier results. Logs, the bench table and BENCHMARKS.md land in
# ${OUT:-gpu-check-out}/.
#
# It needs a Python with CUDA torch and Triton (PYTHON, default python3) and installs nothing from the
# network: the GPU image has torch, Triton, numpy, pytest, pytest-timeout and hypothesis, and kvtune runs
# from this checkout through PYTHONPATH. Wheels carried in .whl/ are installed first, without the network.
set -euo pipefail

out="${OUT:-gpu-check-out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvtune-site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/kvtune-site"
fi
budget_s="${GPU_CHECK_SECONDS:-540}"  # the whole script; the full grid gets what the first two steps leave
started=$SECONDS

"$python" - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, triton
import kvtune.kernels, kvtune.bench.kernels_gpu  # the kernels, and the benchmark that times them
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PY

pytest_args=(-q -p no:cacheprovider -k "not cpu")
failed=0

echo "== 1. representative grid, compiled ($((SECONDS - started)) s)"
"$python" -m pytest tests/kernels "${pytest_args[@]}" 2>&1 | tee "$out/pytest_representative.log" || failed=1

echo "== 2. bench kernels ($((SECONDS - started)) s)"
"$python" -m kvtune.cli bench kernels --skip-cpu --repeats 100 2>&1 | tee "$out/bench.txt" || failed=1
cp BENCHMARKS.md "$out/BENCHMARKS.md"

left=$((budget_s - (SECONDS - started)))
echo "== 3. full grid, ${left} s left"
if [ "$left" -gt 60 ]; then
    timeout "$left" "$python" -m pytest tests/kernels "${pytest_args[@]}" --runslow -x 2>&1 | tee "$out/pytest_full.log" ||
        { echo "full grid: stopped or failed, see pytest_full.log"; failed=1; }
fi
echo "== done in $((SECONDS - started)) s, $([ $failed = 0 ] && echo "all passed" || echo "SOMETHING FAILED")"
exit "$failed"
