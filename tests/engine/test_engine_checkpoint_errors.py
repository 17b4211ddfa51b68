"""A checkpoint kvtune cannot run fails at load time with one KvtuneError that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtune.engine.model.checkpoint import open_checkpoint
from kvtune.engine.model.model import load_model
from kvtune.engine.model.model_config import parse_model_config, parse_rope
from kvtune.errors import KvtuneError
from kvtune.front.text.tokenizer import load_tokenizer


@pytest.fixture
def copy_of_tiny(tiny_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(KvtuneError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def _damage(path: Path, content: str | bytes | None) -> None:
    """Remove the file (None) or overwrite it with `content`."""
    if content is None:
        path.unlink()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


SECOND_SHARD_INDEX = json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        pytest.param("config.json", None, r"config\.json is missing", id="missing_config"),
        pytest.param("config.json", "{not json", "not valid JSON", id="broken_config"),
        pytest.param("model.safetensors", None, r"no \*\.safetensors", id="missing_weights"),
        pytest.param(
            "model.safetensors.index.json",
            SECOND_SHARD_INDEX,
            r"model-00002-of-00002\.safetensors is missing",
            id="missing_shard",
        ),
        pytest.param("model.safetensors", b"\x00" * 64, "cannot read", id="corrupt_weights"),
    ],
)
def test_a_damaged_checkpoint_file_is_named(
    copy_of_tiny: Path, name: str, content: str | bytes | None, message: str
) -> None:
    _damage(copy_of_tiny / name, content)
    with pytest.raises(KvtuneError, match=message):
        load_model(copy_of_tiny)


def test_missing_tensor_is_named(copy_of_tiny: Path) -> None:
    tensors = load_file(copy_of_tiny / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, copy_of_tiny / "model.safetensors")
    with pytest.raises(KvtuneError, match=r"lacks tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_model(copy_of_tiny)


def test_unsupported_architecture(copy_of_tiny: Path) -> None:
    _edit_config(copy_of_tiny, architectures=["GPT2LMHeadModel"])
    with pytest.raises(KvtuneError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        load_model(copy_of_tiny)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"torch_dtype": "float64"}, "dtype 'float64'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"hidden_size": None}, "lacks 'hidden_size'"),
    ],
)
def test_unsupported_settings(copy_of_tiny: Path, changes: dict[str, Any], message: str) -> None:
    _edit_config(copy_of_tiny, **changes)
    with pytest.raises(KvtuneError, match=message):
        open_checkpoint(copy_of_tiny)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        pytest.param("tokenizer.json", None, r"tokenizer\.json is missing", id="missing_tokenizer"),
        pytest.param(
            "chat_template.jinja",
            "{% for m in messages %}",
            "chat template does not compile",
            id="bad_chat_template",
        ),
    ],
)
def test_a_damaged_tokenizer_file_is_named(
    copy_of_tiny: Path, name: str, content: str | None, message: str
) -> None:
    _damage(copy_of_tiny / name, content)
    with pytest.raises(KvtuneError, match=message):
        load_tokenizer(copy_of_tiny)


def test_template_can_refuse_a_conversation(copy_of_tiny: Path) -> None:
    (copy_of_tiny / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(KvtuneError, match="roles must alternate"):
        load_tokenizer(copy_of_tiny).apply_chat_template([{"role": "user", "content": "hi"}])


def test_legacy_rope_fields_and_eos_lists() -> None:
    legacy = {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    rope = parse_rope(legacy)
    assert (rope.theta, rope.scaling_type, rope.factor) == (500000.0, "linear", 2.0)
    config = parse_model_config(
        {
            "architectures": ["MistralForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
            "eos_token_id": [2, 7],
            "torch_dtype": "bfloat16",
        }
    )
    assert config.num_kv_heads == 2 and config.head_dim == 4
    assert config.eos_token_ids == (2, 7) and config.dtype == torch.bfloat16
    assert config.max_model_len == 4096
