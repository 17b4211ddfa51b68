"""Test helpers: a minimal paged runner (block allocation, chunked prefill, decode) and HF reference calls.

The runner hands out block ids in a scrambled order so that a test passes only if every token really is
read back through its block table.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvtune.engine.model.attention_metadata import ScheduledChunk, build_batch
from kvtune.engine.model.kv_cache import KVCache
from kvtune.engine.model.model import CausalLM
from kvtune.kernels import unavailable_reason


@dataclass
class PagedSequence:
    """One sequence's tokens so far, how many are in the cache, and its blocks."""

    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    block_table: list[int] = field(default_factory=list)


class PagedRunner:
    """Runs a CausalLM step by step over a KVCache whose free block ids are shuffled."""

    def __init__(self, model: CausalLM, block_size: int = 16, num_blocks: int = 64, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.cache = KVCache.for_model(
            model.config,
            block_size,
            num_tokens=block_size * num_blocks,
            model_dtype=model.dtype,
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def step(
        self, work: Sequence[tuple[PagedSequence, Sequence[int]]], all_logits: bool = False
    ) -> torch.Tensor:
        """Append each sequence's new tokens and run them in one batch; returns the model's logits."""
        chunks = []
        for sequence, new_tokens in work:
            end = sequence.cached + len(new_tokens)
            while len(sequence.block_table) * self.block_size < end:
                sequence.block_table.append(self.free.pop())
            sequence.tokens.extend(new_tokens)
            chunks.append(ScheduledChunk(list(new_tokens), sequence.cached, list(sequence.block_table)))
        batch = build_batch(chunks, self.block_size, "cpu")
        with torch.no_grad():
            logits: torch.Tensor = self.model(
                batch.input_ids, batch.positions, batch.metadata, self.cache, all_logits
            )
        for sequence, new_tokens in work:
            sequence.cached += len(new_tokens)
        return logits

    def greedy(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: frozenset[int] = frozenset()
    ) -> list[list[int]]:
        """Greedy continuations of all prompts batched together: one prefill step, then decode steps."""
        sequences = [PagedSequence() for _ in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        logits = self.step(list(zip(sequences, prompts, strict=True)))
        live = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            next_tokens = logits.argmax(-1).tolist()
            still = []
            for index, token in zip(live, next_tokens, strict=True):
                outputs[index].append(token)
                if token not in eos_ids and len(outputs[index]) < max_new_tokens:
                    still.append(index)
            live = still
            if not live:
                break
            logits = self.step([(sequences[index], [outputs[index][-1]]) for index in live])
        return outputs


def hf_logits(hf_model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """Transformers' logits `[len(tokens), vocab]` for one sequence run whole."""
    with torch.no_grad():
        logits: torch.Tensor = hf_model(torch.tensor([list(tokens)])).logits[0]
    return logits


def hf_greedy(hf_model: Any, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """The tokens transformers' `generate(do_sample=False)` adds to `prompt`: the yardstick of every greedy
    test, the paged runner's and the engine's alike."""
    with torch.no_grad():
        output = hf_model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
        )
    tokens: list[int] = output[0, len(prompt) :].tolist()
    return tokens


def backend_params() -> list[Any]:
    """The reference oracle and the CPU kernel; the CPU one is skipped, with its reason, if it cannot build."""
    reason = unavailable_reason("cpu")
    return [
        pytest.param("reference"),
        pytest.param("cpu", marks=pytest.mark.skipif(reason is not None, reason=f"cpu backend: {reason}")),
    ]
