"""Our decoder over the paged cache gives transformers' logits: whole prefill, chunked prefill, decode steps
and a mixed batch, on the tiny checkpoint, with the reference and the CPU attention backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runner import PagedRunner, PagedSequence, backend_params, hf_logits

from kvtune.engine.model.model import load_model
from kvtune.front.text.tokenizer import load_tokenizer

ATOL = 1e-4
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "KV caches hold keys and values; paged attention reads them block by block.",
]


@pytest.mark.parametrize("backend", backend_params())
def test_prefill_chunks_and_decode_match_transformers(tiny_dir: Path, hf_tiny: Any, backend: str) -> None:
    model = load_model(tiny_dir, dtype=torch.float32, attention_backend=backend)
    tokenizer = load_tokenizer(tiny_dir)
    for prompt in PROMPTS:
        tokens = tokenizer.encode(prompt)
        expected = hf_logits(hf_tiny, tokens)
        runner = PagedRunner(model)
        sequence = PagedSequence()
        split, decode_from = 23, len(tokens) - 4
        first = runner.step([(sequence, tokens[:split])], all_logits=True)
        torch.testing.assert_close(first, expected[:split], atol=ATOL, rtol=0)
        second = runner.step([(sequence, tokens[split:decode_from])], all_logits=True)
        torch.testing.assert_close(second, expected[split:decode_from], atol=ATOL, rtol=0)
        for position in range(decode_from, len(tokens)):
            step = runner.step([(sequence, [tokens[position]])])
            torch.testing.assert_close(step[0], expected[position], atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", backend_params())
def test_mixed_batch_of_decodes_and_prefills(tiny_dir: Path, hf_tiny: Any, backend: str) -> None:
    model = load_model(tiny_dir, dtype=torch.float32, attention_backend=backend)
    tokenizer = load_tokenizer(tiny_dir)
    token_lists = [tokenizer.encode(prompt) for prompt in PROMPTS]
    expected = [hf_logits(hf_tiny, tokens) for tokens in token_lists]
    runner = PagedRunner(model, seed=7)
    sequences = [PagedSequence() for _ in token_lists]
    runner.step([(sequences[0], token_lists[0][:-1]), (sequences[1], token_lists[1][:30])])
    last = runner.step(
        [
            (sequences[0], token_lists[0][-1:]),
            (sequences[1], token_lists[1][30:]),
            (sequences[2], token_lists[2]),
        ]
    )
    for row, (tokens, reference) in enumerate(zip(token_lists, expected, strict=True)):
        torch.testing.assert_close(last[row], reference[len(tokens) - 1], atol=ATOL, rtol=0)
