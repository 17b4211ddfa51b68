"""The GPU half of `kvtune bench kernels`: Triton paged decode against copy bandwidth, contiguous and SDPA.

For the Qwen3-8B attention geometry (32 query heads, 8 KV heads, head_dim 128, bf16) it times, with CUDA
events (median of many calls, every cache far larger than L2): the Triton kernel on a scrambled block table,
the same kernel on the identity table (a contiguous cache), and torch's scaled_dot_product_attention on a
dense [batch, heads, context, head_dim] cache; then the same paged kernel over an FP8 cache.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvtune.bench.kernels_common import DecodeBatch, make_batch, markdown_table, provenance
from kvtune.kernels.api import paged_decode_attention
from kvtune.kernels.cache_dtype import FP8_DTYPE

QWEN3_8B = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
SHAPES = [(64, 4096), (8, 32768)]
BLOCK_SIZE = 16


def _cuda_time(call: Callable[[], object], repeats: int, inner: int = 10) -> float:
    """Median seconds per call by CUDA events around `inner` back-to-back calls, so launch latency overlaps."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(inner):
            call()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3 / inner)
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = _cuda_time(lambda: target.copy_(source), repeats)
    return 2 * source.numel() / seconds


def _sdpa_time(batch: int, context: int, repeats: int) -> float:
    heads, kv_heads, dim = QWEN3_8B["num_q_heads"], QWEN3_8B["num_kv_heads"], QWEN3_8B["head_dim"]
    q = torch.randn(batch, heads, 1, dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, kv_heads, context, dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    return _cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), repeats)


def run_gpu(repeats: int, seed: int) -> tuple[str, str]:
    """Measure and return (printable table, markdown section)."""
    device = torch.device("cuda")
    ceiling = copy_bandwidth(repeats)
    header = ["shape", "KV dtype", "kernel", "µs/layer", "KV TB/s", "of ceiling", "paged ÷ contiguous"]
    rows: list[list[str]] = []
    bf16_times: dict[tuple[int, int], float] = {}
    for batch, context in SHAPES:
        for label, cache_dtype in (("bf16", torch.bfloat16), ("fp8 e4m3", FP8_DTYPE)):
            case = make_batch(
                [context] * batch,
                **QWEN3_8B,
                block_size=BLOCK_SIZE,
                dtype=torch.bfloat16,
                cache_dtype=cache_dtype,
                device=device,
                seed=seed,
            )
            timings = {}
            for name, tables in (
                ("triton paged", case.paged_tables),
                ("triton contiguous", case.contiguous_tables),
            ):

                def call(tables: torch.Tensor = tables, case: DecodeBatch = case) -> torch.Tensor:
                    return paged_decode_attention(
                        case.q, case.kv_cache, tables, case.seq_lens, case.scale, backend="triton"
                    )

                timings[name] = _cuda_time(call, repeats)
            if cache_dtype == torch.bfloat16:
                timings["torch SDPA (dense)"] = _sdpa_time(batch, context, repeats)
                bf16_times[(batch, context)] = timings["triton paged"]
            shape = f"{batch} x {context}"
            for name, seconds in timings.items():
                rate = case.kv_bytes / seconds
                ratio = f"{seconds / timings['triton contiguous']:.3f}" if name == "triton paged" else ""
                if cache_dtype == FP8_DTYPE and name == "triton paged":
                    ratio += f" (fp8 speedup vs bf16 {bf16_times[(batch, context)] / seconds:.2f}x)"
                rows.append(
                    [
                        shape,
                        label,
                        name,
                        f"{seconds * 1e6:.0f}",
                        f"{rate / 1e12:.2f}",
                        f"{rate / ceiling:.0%}",
                        ratio,
                    ]
                )
            torch.cuda.empty_cache()
    table = markdown_table(header, rows)
    name = torch.cuda.get_device_name(device)
    method = (
        f"Paged decode on {name}, Qwen3-8B attention geometry (32 query heads, 8 KV heads, head_dim 128, bf16 q), "
        f"block size {BLOCK_SIZE}, every sequence at the full context. Median over {repeats} CUDA-event timings of 10 back-to-back calls. "
        f"KV bytes = context tokens x 2 x 8 x 128 x element size (SDPA reads the same bytes from a dense cache). "
        f"Ceiling = device-to-device copy of 1 GiB, read + written bytes: **{ceiling / 1e12:.2f} TB/s**."
    )
    section = "\n\n".join(["## kernels-gpu: `kvtune bench kernels`", method, provenance(), table])
    return f"copy ceiling: {ceiling / 1e12:.2f} TB/s\n{table}", section
