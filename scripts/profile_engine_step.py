"""Where a saturated decode step of the engine spends its time, in-process (no HTTP), by torch's profiler.

    PYTHONPATH=. .venv/bin/python scripts/profile_engine_step.py [DTYPE] [THREADS] [MODEL_DIR] [WARM_STEPS]

Issue 17's configuration: 64 requests of 300-700 random prompt tokens, greedy with ignore_eos, a 32,768-token
pool, block 32, max_num_seqs 64, max_num_batched_tokens 2048. After WARM_STEPS steps (prefill done), 30 steps
are timed without the profiler and 30 with it; the engine's stages are wrapped in record_function scopes
(scheduler, chunks, batch building, model forward, the attention kernels, the KV write, sampling, output
append), and each scope's share of the step is printed with torch's op table. The HTTP side is not here:
profile a live `kvtune serve` with py-spy for it (BENCHMARKS.md says how).
"""

import dataclasses
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import kvtune.engine.model.model_runner as MR
import kvtune.kernels.cpu_backend as CB
from kvtune.engine.loop.llm_engine import LLMEngine
from kvtune.engine.model.engine_config import EngineConfig
from kvtune.engine.model.sampling import SamplingParams

dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
model = sys.argv[3] if len(sys.argv) > 3 else "/root/.cache/kvtune/bench-engine-tiny"
torch.set_num_threads(threads)
cfg = EngineConfig(
    model=model,
    dtype=dtype,
    block_size=32,
    kv_cache_tokens=32768,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    max_model_len=4096,
)
eng = LLMEngine(cfg)
rng = random.Random(0)
vocab = eng.model_config.vocab_size
for i in range(64):
    n = rng.randint(300, 700)
    eng.add_request(
        f"r{i}",
        [rng.randrange(3, vocab) for _ in range(n)],
        SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True),
    )

orig_att = CB._attention


def att(*a, **k):
    with record_function("attention_kernel"):
        return orig_att(*a, **k)


CB._attention = att
be = eng.runner.model.attention_backend


def wrapf(f, label):
    def w(*a, **k):
        with record_function(label):
            return f(*a, **k)

    return w


eng.runner.model.attention_backend = dataclasses.replace(
    be,
    write_kv=wrapf(be.write_kv, "kv_write"),
    decode=wrapf(be.decode, "attn_decode"),
    prefill=wrapf(be.prefill, "attn_prefill"),
)
orig_fwd = eng.runner.model.forward
eng.runner.model.forward = wrapf(orig_fwd, "model_forward")
# prefill everything
t0 = time.perf_counter()
for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 40):
    eng.step()
print(f"prefill done in {time.perf_counter() - t0:.1f}s, running {len(eng.scheduler.running)}")
for _ in range(20):
    eng.step()


# wrap stages with record_function
def wrap(obj, name, label):
    fn = getattr(obj, name)

    def w(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(obj, name, w)


wrap(eng.scheduler, "schedule", "py:schedule")
wrap(eng, "_chunks", "py:chunks")
wrap(eng.runner, "sample", "sampling")
# the step's appends and outputs, where they are since one update_from_output per step (issue 39)
wrap(eng.scheduler, "update_from_output", "py:append")
wrap(eng.output, "process", "py:outputs")
orig_build = MR.build_batch


def bb(*a, **k):
    with record_function("py:build_batch"):
        return orig_build(*a, **k)


MR.build_batch = bb
steps = 30
t0 = time.perf_counter()
for _ in range(steps):
    eng.step()
plain = (time.perf_counter() - t0) / steps
with profile(activities=[ProfilerActivity.CPU]) as prof:
    t0 = time.perf_counter()
    for _ in range(steps):
        with record_function("step"):
            eng.step()
    prof_step = (time.perf_counter() - t0) / steps
print(
    f"step (no profiler): {plain * 1000:.1f} ms, {len(eng.scheduler.running) / plain:.0f} decode tok/s at "
    f"{len(eng.scheduler.running)} running; with profiler {prof_step * 1000:.1f} ms"
)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
ka = {e.key: e for e in prof.key_averages()}
tot = ka["step"].cpu_time_total
for k in [
    "model_forward",
    "aten::mm",
    "attention_kernel",
    "attn_decode",
    "attn_prefill",
    "kv_write",
    "sampling",
    "py:schedule",
    "py:chunks",
    "py:build_batch",
    "py:append",
    "py:outputs",
]:
    if k in ka:
        print(
            f"{k:20s} {ka[k].cpu_time_total / tot * 100:5.1f}%  {ka[k].cpu_time_total / 1000 / steps:7.2f} ms/step"
        )
print(
    "running",
    len(eng.scheduler.running),
    "attn_prefill calls",
    ka["attn_prefill"].count if "attn_prefill" in ka else 0,
    "decode calls",
    ka["attn_decode"].count,
)
