"""The model's shape and numerics, read from a Hugging Face `config.json` into one typed value.

Everything the decoder and the KV cache need is decided here, once, so that the model code never looks at
raw JSON and an unsupported checkpoint fails at load time with one clear message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtune.errors import KvtuneError
from kvtune.front.text.hf_files import token_ids

# architecture -> (q/k/v projections have a bias, o_proj has a bias, per-head q/k RMSNorm)
_ARCHITECTURES: dict[str, tuple[bool, bool, bool]] = {
    "LlamaForCausalLM": (False, False, False),
    "MistralForCausalLM": (False, False, False),
    "Qwen2ForCausalLM": (True, False, False),
    "Qwen3ForCausalLM": (False, False, True),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)

# The one table of model dtypes by name: checkpoint configs and `--dtype` both read it.
MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: `scaling_type` is "default", "linear" or "llama3"."""

    theta: float
    scaling_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: the checkpoint's config.json, validated and with defaults filled in."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    dtype: torch.dtype
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine may run: a sliding window longer than this never binds, a shorter
        one caps it (the kernels attend to the whole context, which equals the window only up to its size)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise KvtuneError(f"config.json lacks {key!r}")
    return raw[key]


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Read RoPE from transformers ≥5 (`rope_parameters`) or older (`rope_theta` + `rope_scaling`) configs."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = str(merged.get("rope_type", merged.get("type", "default")))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, scaling_type="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            scaling_type="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    raise KvtuneError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")


def parse_dtype(raw: dict[str, Any]) -> torch.dtype:
    """The checkpoint's dtype (`dtype` in transformers ≥5, `torch_dtype` before); float32 when absent."""
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in MODEL_DTYPES:
        raise KvtuneError(f"model dtype {name!r} is not supported; use {', '.join(MODEL_DTYPES)}")
    return MODEL_DTYPES[name]


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate a parsed config.json; raise KvtuneError naming the first thing kvtune cannot run."""
    architectures = raw.get("architectures") or []
    known = [name for name in architectures if name in _ARCHITECTURES]
    if not known:
        raise KvtuneError(
            f"architecture {architectures or 'missing'} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    architecture = known[0]
    qkv_bias, o_bias, qk_norm = _ARCHITECTURES[architecture]
    if raw.get("attention_bias"):
        qkv_bias = o_bias = True
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise KvtuneError(f"hidden_act {act!r} is not supported; only silu (SwiGLU)")
    hidden_size = int(_require(raw, "hidden_size"))
    num_heads = int(_require(raw, "num_attention_heads"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads != 0:
        raise KvtuneError(
            f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )
    head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", architecture == "MistralForCausalLM")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(_require(raw, "intermediate_size")),
        num_layers=int(_require(raw, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw),
        dtype=parse_dtype(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=qk_norm,
        sliding_window=int(window) if uses_window and window else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=token_ids(raw.get("eos_token_id")),
    )
