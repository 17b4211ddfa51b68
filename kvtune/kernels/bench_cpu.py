"""The CPU half of `kvtune bench kernels`: paged decode against the machine's memory read bandwidth.

The ceiling is a large float32 tensor sum (what a streaming read reaches with torch's threads). Each case
keeps several layers' caches alive, together far larger than the last-level cache, and calls them in turn
as a model's layers would, so the figure is a DRAM read rate and not a cache-resident one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvtune.kernels.api import paged_decode_attention
from kvtune.kernels.bench_common import DecodeBatch, make_batch, markdown_table, provenance
from kvtune.kernels.cache_dtype import FP8_DTYPE

CEILING_BYTES = 1 << 30
WORKING_SET_BYTES = 512 << 20  # all layers' caches together: many times any CPU's last-level cache
MAX_LAYERS = 32
TINY_GEOMETRY = {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 32}


def read_bandwidth(repeats: int) -> float:
    """Median bytes/s of summing a 1 GiB float32 tensor."""
    data = torch.ones(CEILING_BYTES // 4, dtype=torch.float32)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return CEILING_BYTES / statistics.median(times)


def _time_layers(
    call: Callable[[DecodeBatch], torch.Tensor], layers: list[DecodeBatch], repeats: int
) -> float:
    """Median seconds per layer call, cycling through the layers so each call reads cold memory."""
    for layer in layers:
        call(layer)
    times = []
    for step in range(repeats * len(layers)):
        layer = layers[step % len(layers)]
        start = time.perf_counter()
        call(layer)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_cpu(batch: int, min_context: int, max_context: int, repeats: int, seed: int) -> tuple[str, str]:
    """Measure and return (printable table, markdown section)."""
    started = provenance()
    ceiling = read_bandwidth(max(5, repeats))
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(min_context, max_context + 1, (batch,), generator=gen).tolist()
    cases = [
        ("fp32", torch.float32, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("fp8 e4m3 (bf16 q)", torch.bfloat16, FP8_DTYPE),
    ]
    header = ["backend", "KV dtype", "block", "ms/layer", "KV GB/s", "of ceiling", "cpu speedup"]
    rows: list[list[str]] = []
    medians: list[str] = []
    for label, dtype, cache_dtype in cases:
        for block_size in (16, 32):
            one = make_batch(
                seq_lens,
                **TINY_GEOMETRY,
                block_size=block_size,
                dtype=dtype,
                cache_dtype=cache_dtype,
                device=torch.device("cpu"),
                seed=seed,
            )
            num_layers = min(MAX_LAYERS, max(2, -(-WORKING_SET_BYTES // one.kv_cache.nbytes)))
            layers = [one] + [
                make_batch(
                    seq_lens,
                    **TINY_GEOMETRY,
                    block_size=block_size,
                    dtype=dtype,
                    cache_dtype=cache_dtype,
                    device=torch.device("cpu"),
                    seed=seed + i,
                )
                for i in range(1, num_layers)
            ]
            timings = {}
            for backend, reps in (("cpu", repeats), ("reference", max(2, repeats // 5))):

                def call(layer: DecodeBatch, backend: str = backend) -> torch.Tensor:
                    return paged_decode_attention(
                        layer.q,
                        layer.kv_cache,
                        layer.paged_tables,
                        layer.seq_lens,
                        layer.scale,
                        backend=backend,
                    )

                timings[backend] = _time_layers(call, layers, reps)
            for backend in ("cpu", "reference"):
                seconds = timings[backend]
                rate = one.kv_bytes / seconds
                speedup = f"{timings['reference'] / seconds:.1f}x" if backend == "cpu" else ""
                rows.append(
                    [
                        backend,
                        label,
                        str(block_size),
                        f"{seconds * 1e3:.2f}",
                        f"{rate / 1e9:.1f}",
                        f"{rate / ceiling:.0%}",
                        speedup,
                    ]
                )
                medians.append(f"{backend}/{label}/bs{block_size}: {seconds * 1e3:.3f} ms")
            del layers
    table = markdown_table(header, rows)
    method = (
        f"Paged decode, tiny-model geometry (8 query heads, 2 KV heads, head_dim 32), batch {batch}, contexts uniform "
        f"{min_context}-{max_context} tokens (seed {seed}, {sum(seq_lens)} tokens), scrambled block tables. "
        f"Several layers' caches ({WORKING_SET_BYTES >> 20} MiB together) are called in turn so reads come from DRAM; "
        f"time = median per layer call ({repeats} rounds for cpu). KV bytes = context tokens x 2 x KV heads x "
        f"head_dim x element size. Ceiling = median read rate of summing a 1 GiB float32 tensor: "
        f"**{ceiling / 1e9:.1f} GB/s** with {torch.get_num_threads()} threads."
    )
    section = "\n\n".join(
        [
            "## kernels-cpu: `kvtune bench kernels`",
            method,
            started,
            table,
            "Medians: " + "; ".join(medians) + ".",
        ]
    )
    printable = f"memory read ceiling: {ceiling / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)\n{table}"
    return printable, section
