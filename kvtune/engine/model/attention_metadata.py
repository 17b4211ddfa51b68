"""What one forward pass needs to know about its sequences: where their tokens go and what they attend to.

A batch is flat (varlen): sequence s owns rows `query_start_loc[s]:query_start_loc[s + 1]` of the token
axis. Sequences with exactly one new token at the front of the batch are decodes and take the decode kernel;
the rest take the prefill kernel (which attends to the cached prefix plus the chunk, causally). The engine
puts decodes first to get the faster path; any order is correct.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtune.errors import KvtuneError


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's share of a step: its new tokens, how many tokens are already cached, its blocks."""

    token_ids: Sequence[int]
    context_len: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors the kernels read, built once per step and shared by every layer."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot of each new token
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context + new tokens
    context_lens: torch.Tensor  # int32 [num_seqs]: tokens already in the cache
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with 0
    num_decodes: int  # leading sequences with one new token each
    prefill_query_start_loc: torch.Tensor  # query_start_loc of the prefill part, rebased to 0
    # The longest prefill chunk, known here on the host: a GPU kernel sizes its grid with it, so no layer
    # reads lengths back from the device (a stream stall per layer).
    max_prefill_query_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def last_token_rows(self) -> torch.Tensor:
        """Row of each sequence's last new token: where its next-token logits come from."""
        return (self.query_start_loc[1:] - 1).long()


@dataclass(frozen=True)
class BatchInputs:
    """A step's model inputs: flat token ids and positions plus the attention metadata."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    metadata: AttentionMetadata


def build_batch(
    chunks: Sequence[ScheduledChunk],
    block_size: int,
    device: torch.device | str,
    max_model_len: int | None = None,
) -> BatchInputs:
    """Flatten scheduled chunks into model inputs; each chunk's blocks must cover context + new tokens.

    `max_model_len` is checked here, on the host, because a position past the RoPE table would otherwise
    fail deep in an index (on a GPU, as a device-side assert that kills the process).
    """
    if not chunks:
        raise KvtuneError("a batch needs at least one sequence")
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    for chunk in chunks:
        count = len(chunk.token_ids)
        end = chunk.context_len + count
        if count < 1:
            raise KvtuneError("every scheduled sequence needs at least one new token")
        if max_model_len is not None and end > max_model_len:
            raise KvtuneError(f"a sequence of {end} tokens exceeds max_model_len {max_model_len}")
        if len(chunk.block_table) * block_size < end:
            raise KvtuneError(f"a sequence of {end} tokens does not fit its {len(chunk.block_table)} blocks")
        input_ids.extend(chunk.token_ids)
        for position in range(chunk.context_len, end):
            positions.append(position)
            slots.append(chunk.block_table[position // block_size] * block_size + position % block_size)
        starts.append(starts[-1] + count)
    num_tokens, num_seqs = starts[-1], len(chunks)
    width = max(len(chunk.block_table) for chunk in chunks)
    tables: list[int] = []
    for chunk in chunks:
        tables.extend(chunk.block_table)
        tables.extend([0] * (width - len(chunk.block_table)))
    num_decodes = 0
    while num_decodes < num_seqs and len(chunks[num_decodes].token_ids) == 1:
        num_decodes += 1
    # Two host-to-tensor copies, not seven, through array.array (a third of torch.tensor's cost per element
    # on a list): a decode step's block tables alone are a thousand or more ints. On a GPU, two transfers.
    longs = _int_tensor(input_ids + positions + slots, "q", torch.int64, device)
    ids_view, positions_view, slots_view = torch.split(longs, num_tokens)
    ints = _int_tensor(
        starts
        + [c.context_len + len(c.token_ids) for c in chunks]
        + [c.context_len for c in chunks]
        + tables,
        "i",
        torch.int32,
        device,
    )
    query_start_loc, seq_lens, context_lens, flat_tables = torch.split(
        ints, [num_seqs + 1, num_seqs, num_seqs, num_seqs * width]
    )
    metadata = AttentionMetadata(
        slot_mapping=slots_view,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        context_lens=context_lens,
        block_tables=flat_tables.view(num_seqs, width),
        num_decodes=num_decodes,
        prefill_query_start_loc=query_start_loc[num_decodes:] - num_decodes,
        max_prefill_query_len=max((len(c.token_ids) for c in chunks[num_decodes:]), default=0),
    )
    return BatchInputs(input_ids=ids_view, positions=positions_view, metadata=metadata)


def _int_tensor(
    values: list[int], typecode: str, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A 1-D integer tensor of `values` (typecode: array's code of the same width as dtype); the tensor keeps
    the array alive."""
    host = torch.frombuffer(array.array(typecode, values), dtype=dtype)
    return host if torch.device(device).type == "cpu" else host.to(device)
