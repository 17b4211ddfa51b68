#!/usr/bin/env bash
# One short GPU session for the paged-attention kernels and the engine, run from the repository root on a
# CUDA machine:
#   bash scripts/gpu_check.sh
# 1. the representative correctness grid (what `make test` runs in the Triton interpreter), compiled for real;
# 2. `kvtune bench kernels --skip-cpu` (kvtune/bench/kernels_gpu.py), which records the kernels-gpu section of
#    BENCHMARKS.md;
# 3. the engine end to end: `kvtune serve --device cuda --dtype bfloat16` on the tiny and the small checkpoint
#    (kvtune/bench/engine_gpu.py), each sent the issue-17 batch by kvtune's load generator; tokens/s into
#    engine-gpu.md, both servers' logs into engine-gpu-servers.log. At most GPU_ENGINE_SECONDS (default 240)
#    and never past the budget; GPU_ENGINE_ARGS adds flags (e.g. "--num-requests 32 --models tiny");
# 4. the full grid (--runslow), while time is left.
# The order puts the cheapest decisive check first: a lent machine's minutes are few, and a late step that
# runs out of time still leaves the earlier results. Logs, the tables and BENCHMARKS.md land in
# ${OUT:-gpu-check-out}/ (seven files: a lent machine returns at most eight).
#
# It needs a Python with CUDA torch and Triton (PYTHON, default python3) and installs nothing from the
# network: the GPU image has torch, Triton, numpy, pytest, pytest-timeout, hypothesis, httpx, safetensors,
# tokenizers and jinja2, and kvtune runs from this checkout through PYTHONPATH. Wheels carried in .whl/ are
# installed first, without the network: step 3's server also needs fastapi, starlette, pydantic,
# pydantic-core, typing-inspection, annotated-types, annotated-doc and uvicorn (step 3 names any missing).
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
budget_s="${GPU_CHECK_SECONDS:-540}"  # the whole script; the full grid gets what the first three steps leave
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

# the engine's own budget; the outer guard (SIGTERM at +25 s, which stops the servers, KILL at +40 s) still
# ends 5 s inside the script's budget
left=$((budget_s - (SECONDS - started)))
engine_s=$((left - 45 < ${GPU_ENGINE_SECONDS:-240} ? left - 45 : ${GPU_ENGINE_SECONDS:-240}))
echo "== 3. engine end to end on CUDA, ${engine_s} s of ${left} s left"
if [ "$engine_s" -ge 60 ]; then
    # shellcheck disable=SC2086  # GPU_ENGINE_ARGS is a list of flags
    timeout -k 15 $((engine_s + 25)) "$python" -m kvtune.bench.engine_gpu --device cuda --dtype bfloat16 \
        --seconds "$engine_s" --out "$out" ${GPU_ENGINE_ARGS:-} ||
        { echo "engine end to end: stopped or failed, see engine-gpu.md and engine-gpu-servers.log"; failed=1; }
else
    echo "engine end to end: skipped, too little time left"
    failed=1
fi

left=$((budget_s - (SECONDS - started)))
echo "== 4. full grid, ${left} s left"
if [ "$left" -gt 60 ]; then
    timeout "$left" "$python" -m pytest tests/kernels "${pytest_args[@]}" --runslow -x 2>&1 | tee "$out/pytest_full.log" ||
        { echo "full grid: stopped or failed, see pytest_full.log"; failed=1; }
fi
echo "== done in $((SECONDS - started)) s, $([ $failed = 0 ] && echo "all passed" || echo "SOMETHING FAILED")"
exit "$failed"
