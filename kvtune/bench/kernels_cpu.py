"""The CPU half of `kvtune bench kernels`: paged decode against the machine's memory read bandwidth.

The ceiling is a large reduction: torch's sum of a 1 GiB float32 tensor, and a streaming xor of full-width
vector loads over the same tensor in the kernel library, on huge pages as the KV caches are (with 4 KiB
pages a reduction measures page walks as well). On a shared VM the bandwidth the host leaves moves: over one
session the same stream read gave 33 to 60 GB/s. So each case measures its ceiling just before it runs, and
the ceiling is never taken below the case's `read-only` rate. `read-only` reads the batch's K/V bytes
through the same block tables with no arithmetic: it is what the layout and the memory system allow a paged
decode at best, so the kernel's time is also given as a fraction of it. Each case keeps several layers'
caches alive, together far larger than the last-level cache, and calls them in turn as a model's layers
would, so the figure is a DRAM read rate and not a cache-resident one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvtune.bench import kernel_probes
from kvtune.bench.kernels_common import DecodeBatch, make_batch, markdown_table, provenance
from kvtune.kernels.api import paged_decode_attention
from kvtune.kernels.cache_alloc import allocate_kv_cache
from kvtune.kernels.cache_dtype import FP8_DTYPE

CEILING_BYTES = 1 << 30
WORKING_SET_BYTES = 512 << 20  # all layers' caches together: many times any CPU's last-level cache
MAX_LAYERS = 32
TINY_GEOMETRY = {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 32}


def ceiling_tensor() -> torch.Tensor:
    """1 GiB of float32 on huge pages, as the KV caches get (cache_alloc): with 4 KiB pages a reduction
    measures page walks too."""
    data = allocate_kv_cache(CEILING_BYTES // 8, 1, 1, 1, torch.float32).view(-1)  # [blocks, K/V, 1, 1, 1]
    data.fill_(1.0)
    return data


def read_bandwidth(data: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median bytes/s of reducing `data`, by torch's sum and by the library's streaming read."""
    rates = {}
    for name, reduce in (("torch sum", data.sum), ("vector stream", lambda: kernel_probes.stream_read(data))):
        reduce()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            reduce()
            times.append(time.perf_counter() - start)
        rates[name] = data.numel() * data.element_size() / statistics.median(times)
    return rates


def _time_layers(call: Callable[[DecodeBatch], object], layers: list[DecodeBatch], repeats: int) -> float:
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
    ceiling_data = ceiling_tensor()
    ceilings: list[str] = []
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(min_context, max_context + 1, (batch,), generator=gen).tolist()
    cases = [
        ("fp32", torch.float32, torch.float32),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("fp8 e4m3 (bf16 q)", torch.bfloat16, FP8_DTYPE),
    ]
    header = [
        "backend",
        "KV dtype",
        "block",
        "ms/layer",
        "KV GB/s",
        "ceiling GB/s",
        "of ceiling",
        "of read-only",
        "cpu speedup",
    ]
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
            # The host's bandwidth drifts (33-60 GB/s over one session here): each case gets its own
            # ceiling, measured just before it, and never below what its read-only pass reached.
            reductions = read_bandwidth(ceiling_data, 5)
            timings = {
                "read-only": _time_layers(
                    lambda layer: kernel_probes.read_blocks(
                        layer.q, layer.kv_cache, layer.paged_tables, layer.seq_lens
                    ),
                    layers,
                    repeats,
                )
            }
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
            ceiling = max(*reductions.values(), one.kv_bytes / timings["read-only"])
            ceilings.append(
                f"{label}/bs{block_size}: " + ", ".join(f"{n} {r / 1e9:.1f}" for n, r in reductions.items())
            )
            for backend in ("read-only", "cpu", "reference"):
                seconds = timings[backend]
                rate = one.kv_bytes / seconds
                rows.append(
                    [
                        backend,
                        label,
                        str(block_size),
                        f"{seconds * 1e3:.2f}",
                        f"{rate / 1e9:.1f}",
                        f"{ceiling / 1e9:.1f}",
                        f"{rate / ceiling:.0%}",
                        f"{timings['read-only'] / seconds:.0%}",
                        f"{timings['reference'] / seconds:.1f}x" if backend == "cpu" else "",
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
        f"head_dim x element size. `read-only` reads the same K/V bytes through the same block tables, in the "
        f"kernel's order with its prefetching and threads, and does no arithmetic (`kernel_probes.read_blocks`): "
        f"the most a paged decode over this layout can reach here; `of read-only` = read-only time / kernel "
        f"time. Ceiling, per case = the highest of: the median read rate of reducing a 1 GiB float32 tensor by "
        f"torch's sum and by a vector stream (both on huge pages, measured just before the case, "
        f"{torch.get_num_threads()} threads), and the case's read-only rate. Reductions (GB/s): "
        + "; ".join(ceilings)
        + "."
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
    printable = f"reductions before each case (GB/s, {torch.get_num_threads()} threads): {'; '.join(ceilings)}\n{table}"
    return printable, section
