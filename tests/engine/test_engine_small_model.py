"""`kvtune tiny-model --size small`: the compute-bound benchmark model is the size it says (100-150M
parameters, counted from the written file), its shape flags still override, and greedy decoding on kvtune's
paged model wanders through many tokens instead of collapsing onto one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from engine_runner import PagedRunner
from safetensors import safe_open

from kvtune.engine.model import tiny_model
from kvtune.engine.model.checkpoint import open_checkpoint
from kvtune.engine.model.model import load_model
from kvtune.front.text.tokenizer import load_tokenizer

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
NEW_TOKENS = 32
MIN_DISTINCT = 12  # measured at 26-31 distinct of 48 tokens per prompt; one repeated token would be 1


def _run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    tiny_model.add_arguments(parser)
    return tiny_model.run(parser.parse_args(list(argv)))


def _tensor_elements(folder: Path) -> int:
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118 (safe_open is no dict)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Written in bfloat16 (half the bytes, the same draws rounded): the bench serves it in bfloat16 too."""
    spec = dataclasses.replace(tiny_model.MODEL_SIZES["small"], dtype="bfloat16")
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("small"), spec)


def test_small_size_is_100_to_150m_parameters_counted_from_the_file(small_dir: Path) -> None:
    small = tiny_model.MODEL_SIZES["small"]
    counted = _tensor_elements(small_dir)
    assert counted == tiny_model.parameter_count(small) == 135_822_336
    assert 100e6 <= counted <= 150e6
    config = open_checkpoint(small_dir).config
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape == (12, 1024, 16, 4, 64)
    assert json.loads((small_dir / "config.json").read_text())["intermediate_size"] == 2816


def test_tiny_size_is_unchanged() -> None:
    assert tiny_model.MODEL_SIZES["tiny"] == tiny_model.TinyModelSpec()
    assert tiny_model.parameter_count(tiny_model.MODEL_SIZES["tiny"]) == 2_363_136


def test_small_greedy_decoding_does_not_collapse(small_dir: Path) -> None:
    model = load_model(small_dir, dtype=torch.bfloat16, attention_backend="reference")
    tokenizer = load_tokenizer(small_dir)
    outputs = PagedRunner(model).greedy([tokenizer.encode(prompt) for prompt in PROMPTS], NEW_TOKENS)
    distinct = [len(set(tokens)) for tokens in outputs]
    assert all(len(tokens) == NEW_TOKENS for tokens in outputs)
    assert min(distinct) >= MIN_DISTINCT, f"distinct tokens per prompt: {distinct}"
    assert all(len(set(tokens[-10:])) > 1 for tokens in outputs)


def test_size_flag_and_shape_flags_override_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli(str(tmp_path / "small1"), "--size", "small", "--num-layers", "1") == 0
    out = capsys.readouterr().out
    config = open_checkpoint(tmp_path / "small1").config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (1, 1024, 16, 4)
    one_layer = dataclasses.replace(tiny_model.MODEL_SIZES["small"], num_layers=1)
    assert _tensor_elements(tmp_path / "small1") == tiny_model.parameter_count(one_layer)
    assert f"{tiny_model.parameter_count(one_layer):,} parameters" in out
