"""The benchmark's two bounds read what they claim: every K/V byte of the batch through its block tables
(read_blocks), and a whole tensor (stream_read). Each returns the xor of the 32-bit words it loaded, so the
checksum is compared with the same xor computed here from the tensors."""

from __future__ import annotations

import functools
import operator

import pytest
import torch

from kvtune.bench import kernel_probes
from kvtune.bench.kernels_common import make_batch
from kvtune.kernels.cache_dtype import FP8_DTYPE

pytestmark = pytest.mark.skipif(
    kernel_probes.available() is not None, reason="no C++ compiler for the cpu backend"
)


def xor_words(t: torch.Tensor) -> int:
    words = t.contiguous().view(torch.int32).flatten().tolist()
    return functools.reduce(operator.xor, words, 0) & 0xFFFFFFFF


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("block_size", [16, 32])
def test_read_blocks_reads_exactly_the_context_rows(dtype: torch.dtype, block_size: int) -> None:
    seq_lens = [1, 37, block_size, 3 * block_size + 5]
    batch = make_batch(seq_lens, 8, 2, 32, block_size, torch.bfloat16 if dtype != torch.float32 else dtype,
                       dtype, torch.device("cpu"), seed=3)  # fmt: skip
    expected = 0
    for seq, length in enumerate(seq_lens):
        for t in range(length):
            block = int(batch.paged_tables[seq, t // block_size])
            expected ^= xor_words(batch.kv_cache[block, :, t % block_size])  # K and V rows, every head
    assert kernel_probes.read_blocks(batch.q, batch.kv_cache, batch.paged_tables, batch.seq_lens) == expected


def test_stream_read_reads_the_whole_tensor() -> None:
    data = torch.randint(-(2**31), 2**31 - 1, (4096 + 16,), dtype=torch.int32)
    assert kernel_probes.stream_read(data) == xor_words(data)
