"""Every supported architecture gives transformers' logits: small random checkpoints written by
transformers' own classes (Qwen3 q/k norm, Qwen2 q/k/v bias, Mistral, llama3 and linear RoPE scaling, tied
embeddings, a sharded checkpoint, a bf16 checkpoint), run through the paged cache in two chunks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runner import PagedRunner, PagedSequence, backend_params, hf_logits

from kvtune.engine.model.checkpoint import open_checkpoint
from kvtune.engine.model.model import load_model
from kvtune.engine.model.model_config import ModelConfig

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# case -> (transformers family, config overrides, the ModelConfig feature the case exercises)
CASES: dict[str, tuple[str, dict[str, Any], Callable[[ModelConfig], bool]]] = {
    "qwen3": ("Qwen3", {"head_dim": 32}, lambda c: c.qk_norm and not c.qkv_bias),
    "qwen2": ("Qwen2", {}, lambda c: c.qkv_bias and not c.o_bias),
    "mistral": ("Mistral", {"sliding_window": None}, lambda c: c.architecture == "MistralForCausalLM"),
    "llama3-rope": (
        "Llama",
        {"head_dim": 32, "rope_parameters": LLAMA3_ROPE},
        lambda c: c.rope.factor == 8.0,
    ),
    "linear-rope": (
        "Llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        lambda c: c.rope.scaling_type == "linear",
    ),
    "tied": ("Llama", {"tie_word_embeddings": True}, lambda c: c.tie_word_embeddings),
    "attention-bias": ("Llama", {"attention_bias": True}, lambda c: c.o_bias and c.qkv_bias),
    "mlp-bias": ("Llama", {"mlp_bias": True}, lambda c: c.mlp_bias),
}


def _write(transformers: Any, family: str, extra: dict[str, Any], folder: Path, **save: Any) -> Any:
    config = getattr(transformers, f"{family}Config")(**SMALL, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # HF zero-inits biases; random ones make the bias path observable
        for name, parameter in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(folder, **save)
    return model


def _assert_two_chunks_match(
    folder: Path, hf_model: Any, backend: str, dtype: torch.dtype, atol: float
) -> None:
    model = load_model(folder, dtype=dtype, attention_backend=backend)
    tokens = torch.randint(0, SMALL["vocab_size"], (90,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(hf_model, tokens)
    runner = PagedRunner(model, seed=5)
    sequence = PagedSequence()
    first = runner.step([(sequence, tokens[:37])], all_logits=True)
    second = runner.step([(sequence, tokens[37:])], all_logits=True)
    torch.testing.assert_close(torch.cat([first, second]).float(), expected, atol=atol, rtol=0)


@pytest.fixture(scope="module", params=list(CASES))
def written_case(
    request: pytest.FixtureRequest, transformers: Any, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    family, extra, exercised = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = _write(transformers, family, extra, folder)
    assert exercised(open_checkpoint(folder).config), f"{request.param} does not exercise its feature"
    return folder, hf_model


@pytest.mark.parametrize("backend", backend_params())
def test_architecture_matches_transformers(written_case: tuple[Path, Any], backend: str) -> None:
    folder, hf_model = written_case
    _assert_two_chunks_match(folder, hf_model, backend, torch.float32, atol=1e-4)


def test_sharded_checkpoint_loads(transformers: Any, tmp_path: Path) -> None:
    hf_model = _write(transformers, "Llama", {}, tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _assert_two_chunks_match(tmp_path, hf_model, "reference", torch.float32, atol=1e-4)


def test_bf16_checkpoint_runs_in_bf16(transformers: Any, tmp_path: Path) -> None:
    hf_model = _write(transformers, "Llama", {}, tmp_path / "fp32")
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = load_model(tmp_path / "bf16", attention_backend="reference")
    assert model.config.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    _assert_two_chunks_match(tmp_path / "bf16", hf_model.float(), "reference", torch.bfloat16, atol=5e-2)
