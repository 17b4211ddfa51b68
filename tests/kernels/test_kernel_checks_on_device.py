"""The kernel API's input checks read tensor values only when the tensors live on the CPU: on a GPU each
read is a device-to-host sync. Meta tensors stand in for a GPU here (no GPU on this machine): reading a
meta tensor's values raises, so a check that tried would fail these tests."""

from __future__ import annotations

import pytest
import torch

from kvtune.errors import KvtuneError
from kvtune.kernels.checks import check_block_tables, check_query_start_loc


def test_query_start_loc_values_are_checked_on_the_cpu() -> None:
    seq_lens = torch.tensor([4, 3], dtype=torch.int32)
    check_query_start_loc(torch.tensor([0, 2, 5], dtype=torch.int32), seq_lens, 5)
    with pytest.raises(KvtuneError, match="rise from 0"):
        check_query_start_loc(torch.tensor([0, 2, 4], dtype=torch.int32), seq_lens, 5)
    with pytest.raises(KvtuneError, match="more new tokens than its seq_len"):
        check_query_start_loc(torch.tensor([0, 1, 5], dtype=torch.int32), seq_lens, 5)


def test_values_on_another_device_are_never_read() -> None:
    meta = torch.device("meta")
    seq_lens = torch.empty(2, dtype=torch.int32, device=meta)
    check_query_start_loc(torch.empty(3, dtype=torch.int32, device=meta), seq_lens, 5)
    check_block_tables(torch.empty(2, 4, dtype=torch.int32, device=meta), 2, seq_lens, 16)
