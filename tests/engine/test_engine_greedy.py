"""Greedy generation over the paged cache (block size 16, scrambled block ids, prompts batched together)
equals transformers' `generate(do_sample=False)` token for token, and is not one repeated token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runner import PagedRunner, backend_params, hf_greedy

from kvtune.engine.model.model import load_model
from kvtune.front.text.tokenizer import load_tokenizer

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5", "Once upon a time, in a land far away,"]
NEW_TOKENS = 20


@pytest.mark.parametrize("backend", backend_params())
def test_greedy_matches_transformers_generate(tiny_dir: Path, hf_tiny: Any, backend: str) -> None:
    model = load_model(tiny_dir, dtype=torch.float32, attention_backend=backend)
    tokenizer = load_tokenizer(tiny_dir)
    prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
    ours = PagedRunner(model, seed=3).greedy(prompts, NEW_TOKENS, tokenizer.eos_token_ids)
    for prompt, generated in zip(prompts, ours, strict=True):
        assert generated == hf_greedy(hf_tiny, prompt, NEW_TOKENS)


def test_tiny_model_greedy_output_is_not_degenerate(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, attention_backend="reference")
    tokenizer = load_tokenizer(tiny_dir)
    outputs = PagedRunner(model).greedy([tokenizer.encode(prompt) for prompt in PROMPTS], 40)
    tails = [len(set(tokens[-10:])) for tokens in outputs]
    assert all(distinct > 1 for distinct in tails), f"distinct tokens in the last 10 per prompt: {tails}"
