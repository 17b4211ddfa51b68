"""KV cache sizing (tokens or bytes, auto or FP8 dtype), garbage in unwritten slots, and the batch builder's
metadata."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_runner import PagedRunner, PagedSequence, backend_params

from kvtune.engine.model.attention_metadata import ScheduledChunk, build_batch
from kvtune.engine.model.checkpoint import open_checkpoint
from kvtune.engine.model.kv_cache import KVCache
from kvtune.engine.model.model import load_model
from kvtune.errors import KvtuneError
from kvtune.kernels import FP8_DTYPE


def test_sizes_by_tokens_and_bytes(tiny_dir: Path) -> None:
    config = open_checkpoint(tiny_dir).config
    by_tokens = KVCache.for_model(config, 16, num_tokens=1000)
    assert by_tokens.num_blocks == 62 and by_tokens.num_tokens == 992
    assert by_tokens.layers[0].shape == (62, 2, 16, 2, 32) and len(by_tokens.layers) == 4
    assert by_tokens.dtype == torch.float32 and by_tokens.dtype_name == "float32"
    per_token_fp32 = 2 * 2 * 32 * 4 * 4  # K and V, 2 KV heads, head_dim 32, 4 bytes, 4 layers
    by_bytes = KVCache.for_model(config, 32, memory_bytes=per_token_fp32 * 32 * 10 + 5)
    assert by_bytes.num_blocks == 10
    fp8 = KVCache.for_model(config, 32, memory_bytes=per_token_fp32 * 32 * 10, cache_dtype="fp8")
    assert fp8.num_blocks == 40 and fp8.dtype == FP8_DTYPE and fp8.dtype_name == "fp8_e4m3"


def test_sizing_errors(tiny_dir: Path) -> None:
    config = open_checkpoint(tiny_dir).config
    with pytest.raises(KvtuneError, match="not both or neither"):
        KVCache.for_model(config, 16)
    with pytest.raises(KvtuneError, match="less than one block"):
        KVCache.for_model(config, 16, num_tokens=15)
    with pytest.raises(KvtuneError, match="multiple of 16"):
        KVCache.for_model(config, 24, num_tokens=1024)
    with pytest.raises(KvtuneError, match="unknown kv cache dtype"):
        KVCache.for_model(config, 16, num_tokens=1024, cache_dtype="int4")


def test_batch_metadata_puts_slots_in_the_right_blocks() -> None:
    chunks = [
        ScheduledChunk([5], context_len=17, block_table=[7, 2]),
        ScheduledChunk([1, 2, 3], context_len=15, block_table=[4, 9]),
        ScheduledChunk([8, 9], context_len=0, block_table=[3]),
    ]
    batch = build_batch(chunks, 16, "cpu")
    meta = batch.metadata
    assert batch.input_ids.tolist() == [5, 1, 2, 3, 8, 9]
    assert batch.positions.tolist() == [17, 15, 16, 17, 0, 1]
    assert meta.slot_mapping.tolist() == [2 * 16 + 1, 4 * 16 + 15, 9 * 16, 9 * 16 + 1, 3 * 16, 3 * 16 + 1]
    assert meta.query_start_loc.tolist() == [0, 1, 4, 6]
    assert meta.seq_lens.tolist() == [18, 18, 2] and meta.context_lens.tolist() == [17, 15, 0]
    assert meta.block_tables.tolist() == [[7, 2], [4, 9], [3, 0]]
    assert meta.num_decodes == 1 and meta.prefill_query_start_loc.tolist() == [0, 3, 5]
    assert meta.last_token_rows.tolist() == [0, 3, 5]


def test_batch_builder_rejects_bad_chunks() -> None:
    with pytest.raises(KvtuneError, match="at least one sequence"):
        build_batch([], 16, "cpu")
    with pytest.raises(KvtuneError, match="at least one new token"):
        build_batch([ScheduledChunk([], 3, [0])], 16, "cpu")
    with pytest.raises(KvtuneError, match="does not fit"):
        build_batch([ScheduledChunk([1, 2], 15, [0])], 16, "cpu")
    with pytest.raises(KvtuneError, match="exceeds max_model_len 16"):
        build_batch([ScheduledChunk([1, 2], 15, [0, 1])], 16, "cpu", max_model_len=16)


@pytest.mark.parametrize("backend", backend_params())
def test_unwritten_slots_never_leak_into_attention(tiny_dir: Path, backend: str) -> None:
    """The cache is allocated uninitialised (and blocks are reused after frees): NaN in every slot not yet
    written must not change a single logit."""
    model = load_model(tiny_dir, attention_backend=backend)
    tokens = list(range(40, 90))
    expected = PagedRunner(model).step([(PagedSequence(), tokens)], all_logits=True)
    dirty = PagedRunner(model)
    for layer in dirty.cache.layers:
        layer.fill_(float("nan"))
    sequence = PagedSequence()
    first = dirty.step([(sequence, tokens[:20])], all_logits=True)
    second = dirty.step([(sequence, tokens[20:])], all_logits=True)
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=1e-5, rtol=0)
    assert not dirty.step([(sequence, [3])]).isnan().any()
