"""`kvtune tiny-model DIR` writes a real Hugging Face checkpoint: transformers loads it, its tokenizer and
chat template agree with ours, and the weights are a function of the seed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtune.engine.model import tiny_model
from kvtune.engine.model.checkpoint import open_checkpoint
from kvtune.errors import KvtuneError
from kvtune.front.text.tokenizer import load_tokenizer

TEXTS = ["Hello, world!", "héllo wörld — ✓ 🚀", "line one\nline two\ttabbed", ""]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]


def _run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    tiny_model.add_arguments(parser)
    return tiny_model.run(parser.parse_args(list(argv)))


def test_folder_has_the_hf_files_and_default_shape(tiny_dir: Path) -> None:
    names = {path.name for path in tiny_dir.iterdir()}
    expected = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"}
    assert expected | {"tokenizer_config.json"} <= names
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    config = open_checkpoint(tiny_dir).config
    shape = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape == (4, 256, 8, 2, 32)
    assert config.max_position_embeddings == 4096
    assert config.vocab_size == load_tokenizer(tiny_dir).vocab_size


def test_transformers_loads_model_and_tokenizer(transformers: Any, tiny_dir: Path, hf_tiny: Any) -> None:
    assert type(hf_tiny).__name__ == "LlamaForCausalLM"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ours = load_tokenizer(tiny_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf_tokenizer(text)["input_ids"]
        assert ours.decode(ours.encode(text)) == text
    expected_text = hf_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(CONVERSATION) == expected_text
    expected_ids = hf_tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours.encode_chat(CONVERSATION) == expected_ids
    hf_eos = hf_tiny.generation_config.eos_token_id
    assert ours.eos_token_ids == set(hf_eos if isinstance(hf_eos, list) else [hf_eos])


def test_weights_are_a_function_of_the_seed(tmp_path: Path, tiny_dir: Path) -> None:
    assert _run_cli(str(tmp_path / "same"), "--seed", "0") == 0
    assert _run_cli(str(tmp_path / "other"), "--seed", "1") == 0
    default_bytes = (tiny_dir / "model.safetensors").read_bytes()
    assert (tmp_path / "same" / "model.safetensors").read_bytes() == default_bytes
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != default_bytes


def test_cli_rejects_impossible_shapes(tmp_path: Path) -> None:
    with pytest.raises(KvtuneError, match="multiple of"):
        _run_cli(str(tmp_path / "bad"), "--num-heads", "6", "--num-kv-heads", "4")
    with pytest.raises(KvtuneError, match="positive"):
        _run_cli(str(tmp_path / "bad"), "--num-layers", "0")
    (tmp_path / "file").write_text("x")
    with pytest.raises(KvtuneError, match="not a folder"):
        _run_cli(str(tmp_path / "file"))


def test_kvtune_cli_verb_writes_a_loadable_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtune.cli import main

    assert main(["tiny-model", str(tmp_path / "cli"), "--num-layers", "2", "--dtype", "bfloat16"]) == 0
    assert "2-layer" in capsys.readouterr().out
    config = open_checkpoint(tmp_path / "cli").config
    assert config.num_layers == 2 and config.dtype == torch.bfloat16
    assert main(["tiny-model", str(tmp_path / "bad"), "--num-heads", "6", "--num-kv-heads", "4"]) == 2
    assert "multiple of" in capsys.readouterr().err
