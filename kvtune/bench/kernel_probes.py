"""The kernel benchmark's two read bounds, compiled from their own source (csrc/kernel_probes.cpp) so the
production kernel carries no benchmark code: a streaming read of a whole tensor, and a read of every K/V byte
a decode step reads, in the kernel's order. Built and loaded by the kernel's own machinery (cpu_build)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvtune.errors import KvtuneError
from kvtune.kernels.cpu_backend import kernel_params
from kvtune.kernels.cpu_build import load

SOURCE = Path(__file__).parent / "csrc" / "kernel_probes.cpp"


def available() -> str | None:
    """None when the probes can run here, else why not (no compiler, build failure)."""
    try:
        load(SOURCE)
    except KvtuneError as err:
        return str(err)
    return None


def stream_read(data: torch.Tensor) -> int:
    """Read a contiguous CPU tensor front to back with full-width vector loads on torch's thread count
    (the bytes up to a multiple of 64); returns a checksum. The benchmark's sequential-read ceiling."""
    library = load(SOURCE)
    library.kvt_stream_read.restype = ctypes.c_uint64
    library.kvt_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]
    nbytes = data.numel() * data.element_size() // 64 * 64
    return int(library.kvt_stream_read(data.contiguous().data_ptr(), nbytes, torch.get_num_threads()))


def read_blocks(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> int:
    """Read every K/V byte a decode step over this batch reads, in the kernel's order, prefetching and
    threads, with no arithmetic; returns a checksum. The benchmark's bound for what the layout allows."""
    queries = q.to(torch.float32).contiguous()
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    params = kernel_params(
        queries,
        kv_cache,
        block_tables.contiguous(),
        starts,
        seq_lens.contiguous(),
        None,
        None,
        1.0,
        1.0,
        1.0,
        1,
        1,
        False,
    )
    library = load(SOURCE)
    library.kvt_read_blocks.restype = ctypes.c_uint64
    return int(library.kvt_read_blocks(ctypes.byref(params)))
