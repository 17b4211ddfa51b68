"""The per-layer kernel path reads nothing back from the device: every length a kernel needs on the host
is computed once per step by the batch builder, and the attention backend is resolved once, at load.

No GPU here, so the proof is on the CPU: a forward pass runs under a torch function mode that records
every host read (`.cpu()`, `.item()`, `.tolist()`, `int()`, `bool()`, ...) of a tensor, with a recording
backend standing in for the kernels. On CUDA each of those reads would be a stream sync.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvtune.engine.model.attention_metadata import ScheduledChunk, build_batch
from kvtune.engine.model.kv_cache import KVCache
from kvtune.engine.model.model import load_model
from kvtune.kernels import backends
from kvtune.kernels.backends import Backend

HOST_READS = {"cpu", "item", "tolist", "numpy", "__int__", "__bool__", "__float__", "__index__"}
BLOCK_SIZE = 16


class HostReads(TorchFunctionMode):
    """Records each tensor function called that copies a value from the tensor's device to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        is_host_copy = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values()))
        if name in HOST_READS or is_host_copy:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


class RecordingBackend:
    """Kernels that do nothing but record what they were called with (outputs are zeros)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def decode(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(("decode", kwargs))
        return torch.zeros_like(q)

    def prefill(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(("prefill", kwargs))
        return torch.zeros_like(q)

    def write_kv(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("write_kv", kwargs))

    def as_backend(self) -> Backend:
        return Backend("recording", self.decode, self.prefill, self.write_kv)


def mixed_batch(config: Any) -> tuple[Any, KVCache]:
    """Two decodes and two prefill chunks (one over a cached prefix), on scattered blocks."""
    cache = KVCache.for_model(config, BLOCK_SIZE, num_tokens=64 * BLOCK_SIZE)
    # the decodes and the chunk over a cached prefix read slots an earlier step would have written; the pool
    # is allocated uninitialised, and stale bytes there can be NaN (a clean-clone run failed on that once)
    for layer in cache.layers:
        layer.zero_()
    chunks = [
        ScheduledChunk([5], 20, [3, 9]),
        ScheduledChunk([6], 7, [4]),
        ScheduledChunk(list(range(10, 40)), 0, [11, 2]),
        ScheduledChunk(list(range(40, 52)), 16, [7, 30]),
    ]
    return build_batch(chunks, BLOCK_SIZE, "cpu"), cache


def test_a_forward_pass_reads_no_length_back_from_the_device(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, dtype=torch.float32, attention_backend="reference")
    recording = RecordingBackend()
    model.attention_backend = recording.as_backend()
    batch, cache = mixed_batch(model.config)
    with torch.inference_mode(), HostReads() as reads:
        model(batch.input_ids, batch.positions, batch.metadata, cache)
    assert reads.seen == []
    layers = model.config.num_layers
    assert [name for name, _ in recording.calls] == ["write_kv", "decode", "prefill"] * layers
    prefill_sizes = [kwargs["max_query_len"] for name, kwargs in recording.calls if name == "prefill"]
    assert prefill_sizes == [30] * layers  # the longest prefill chunk, a host int from the batch builder


def test_the_batch_builder_knows_the_longest_prefill_chunk_on_the_host() -> None:
    decodes_only = build_batch([ScheduledChunk([1], 3, [0]), ScheduledChunk([2], 9, [1])], BLOCK_SIZE, "cpu")
    assert decodes_only.metadata.max_prefill_query_len == 0
    mixed = build_batch(
        [ScheduledChunk([1], 3, [0]), ScheduledChunk([2, 3, 4], 0, [1]), ScheduledChunk([5] * 7, 2, [2])],
        BLOCK_SIZE,
        "cpu",
    )
    assert mixed.metadata.max_prefill_query_len == 7


def test_the_backend_is_resolved_at_load_not_per_call(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(tiny_dir, dtype=torch.float32, attention_backend="reference")
    assert model.attention_backend.name == "reference"
    lookups: list[str] = []
    resolve = backends.get_backend

    def counting(name: str) -> Backend:
        lookups.append(name)
        return resolve(name)

    monkeypatch.setattr(backends, "get_backend", counting)
    batch, cache = mixed_batch(model.config)
    with torch.inference_mode():
        logits = model(batch.input_ids, batch.positions, batch.metadata, cache)
    assert lookups == []
    assert logits.shape == (4, model.config.vocab_size) and bool(torch.isfinite(logits).all())
