"""`kvtune tiny-model DIR`: write the embedded default model, a seeded random-weight Llama checkpoint.

The folder is a complete Hugging Face checkpoint (config, safetensors with HF names, generation config,
tokenizer, chat template), so vLLM and transformers load it exactly as kvtune does: the same model serves
as the yardstick comparison and the engine's default.

Two sizes (`--size`): `tiny` (about 2M parameters), where a step's time goes to the engine's own overhead,
and `small` (about 136M), where the matmuls dominate; benchmarks on both bound the engine from both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvtune.errors import KvtuneError
from kvtune.front.text.tiny_tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    build_byte_tokenizer,
    special_id,
    tokenizer_config,
)

_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model (defaults are the issue's: 4 layers, hidden 256, 8 heads, 2 KV heads)."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 500000.0
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.02
    embedding_std: float = 1.0


# The shapes `--size` names, shared by `kvtune bench engine --model` and the GPU check so all three agree.
# small: Llama architecture with GQA (16 heads over 4 KV heads) and SwiGLU at ~2.75x hidden, ~136M
# parameters with the byte tokenizer's 259-token vocabulary (almost all of it in the 12 decoder layers).
MODEL_SIZES: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "small": TinyModelSpec(
        num_layers=12, hidden_size=1024, num_heads=16, num_kv_heads=4, head_dim=64, intermediate_size=2816
    ),
}
DEFAULT_SIZE = "tiny"


def byte_vocab_size() -> int:
    """The vocabulary every size is written with (256 bytes plus the special tokens)."""
    return int(build_byte_tokenizer().get_vocab_size())


def parameter_count(spec: TinyModelSpec, vocab_size: int | None = None) -> int:
    """Every weight the checkpoint holds (embeddings, lm_head and the norms included; untied)."""
    vocab = byte_vocab_size() if vocab_size is None else vocab_size
    hidden, inter = spec.hidden_size, spec.intermediate_size
    attention = hidden * spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return 2 * vocab * hidden + spec.num_layers * per_layer + hidden


def describe_shape(spec: TinyModelSpec) -> str:
    return (
        f"{spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads, {spec.num_kv_heads} "
        f"KV heads, head_dim {spec.head_dim}, intermediate {spec.intermediate_size}"
    )


def describe(spec: TinyModelSpec) -> str:
    """One line for tables and logs: the shape and the honest parameter count."""
    return (
        f"{describe_shape(spec)}, {parameter_count(spec):,} parameters ({parameter_count(spec) / 1e6:.1f}M)"
    )


def _config_json(spec: TinyModelSpec, vocab_size: int, bos_id: int, eos_ids: list[int]) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0],
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }


def random_weights(spec: TinyModelSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    """HF-named tensors drawn from one seeded generator in a fixed order, so a seed means one model.

    Embeddings are drawn at std 1 (torch's own default) and the rest at HF's 0.02: with embeddings at
    0.02 too, the attention output outweighs the current token and greedy decoding collapses onto one
    repeated token within a few steps; with the token dominant it wanders through many tokens.
    """
    generator = torch.Generator().manual_seed(spec.seed)
    dtype = _DTYPE_NAMES[spec.dtype]
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    def normal(*shape: int, std: float = spec.init_std) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    tensors = {"model.embed_tokens.weight": normal(vocab_size, hidden, std=spec.embedding_std)}
    for index in range(spec.num_layers):
        prefix = f"model.layers.{index}."
        tensors[prefix + "self_attn.q_proj.weight"] = normal(q_rows, hidden)
        tensors[prefix + "self_attn.k_proj.weight"] = normal(kv_rows, hidden)
        tensors[prefix + "self_attn.v_proj.weight"] = normal(kv_rows, hidden)
        tensors[prefix + "self_attn.o_proj.weight"] = normal(hidden, q_rows)
        tensors[prefix + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[prefix + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[prefix + "mlp.down_proj.weight"] = normal(hidden, inter)
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=dtype)
    tensors["lm_head.weight"] = normal(vocab_size, hidden)
    return tensors


def write_tiny_model(folder: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the checkpoint into `folder` (created if absent; existing checkpoint files are replaced)."""
    if spec.dtype not in _DTYPE_NAMES:
        raise KvtuneError(f"dtype {spec.dtype!r} is not one of {', '.join(_DTYPE_NAMES)}")
    if spec.num_heads % spec.num_kv_heads != 0:
        raise KvtuneError(
            f"--num-heads {spec.num_heads} is not a multiple of --num-kv-heads {spec.num_kv_heads}"
        )
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise KvtuneError(f"{path} exists and is not a folder")
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_byte_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    bos_id = special_id(tokenizer, BOS_TOKEN)
    eos_ids = [special_id(tokenizer, EOS_TOKEN), special_id(tokenizer, EOT_TOKEN)]
    tokenizer.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", tokenizer_config())
    _write_json(path / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOT_TOKEN})
    _write_json(path / "config.json", _config_json(spec, vocab_size, bos_id, eos_ids))
    _write_json(path / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_ids})
    weights = path / "model.safetensors"
    save_file(random_weights(spec, vocab_size), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes 0600; a server in another container or user must read it
    return path


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


_SHAPE_FLAGS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TinyModelSpec()
    parser.add_argument("dir", metavar="DIR", help="folder to write the checkpoint into")
    parser.add_argument(
        "--size",
        choices=sorted(MODEL_SIZES),
        default=DEFAULT_SIZE,
        help="tiny: "
        + describe_shape(MODEL_SIZES["tiny"])
        + "; small: "
        + describe_shape(MODEL_SIZES["small"])
        + " (the shape flags below override the size's values)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="weights are a function of the seed")
    for name in _SHAPE_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, help="default: the --size's value")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_NAMES), default=defaults.dtype)


def spec_from_args(args: argparse.Namespace) -> TinyModelSpec:
    """The --size's spec with every shape flag given on the command line put over it."""
    overrides = {name: getattr(args, name) for name in _SHAPE_FLAGS if getattr(args, name) is not None}
    if any(value < 1 for value in overrides.values()):
        raise KvtuneError("model sizes must be positive")
    return dataclasses.replace(MODEL_SIZES[args.size], dtype=args.dtype, seed=args.seed, **overrides)


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    path = write_tiny_model(args.dir, spec)
    print(
        f"wrote a {spec.num_layers}-layer Llama checkpoint (seed {spec.seed}, {spec.dtype}; {describe(spec)}) "
        f"to {path}"
    )
    return 0
