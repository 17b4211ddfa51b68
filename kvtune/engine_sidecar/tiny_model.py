"""`kvtune tiny-model DIR`: write the embedded default model, a seeded random-weight Llama checkpoint.

The folder is a complete Hugging Face checkpoint (config, safetensors with HF names, generation config,
tokenizer, chat template), so vLLM and transformers load it exactly as kvtune does: the same model serves
as the yardstick comparison and the engine's default.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvtune.engine_sidecar.tiny_tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    build_byte_tokenizer,
    special_id,
    tokenizer_config,
)
from kvtune.errors import KvtuneError

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TinyModelSpec()
    parser.add_argument("dir", metavar="DIR", help="folder to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="weights are a function of the seed")
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num-heads", type=int, default=defaults.num_heads)
    parser.add_argument("--num-kv-heads", type=int, default=defaults.num_kv_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--max-position-embeddings", type=int, default=defaults.max_position_embeddings)
    parser.add_argument("--dtype", choices=sorted(_DTYPE_NAMES), default=defaults.dtype)


def run(args: argparse.Namespace) -> int:
    sizes = (args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim)
    if min(*sizes, args.intermediate_size, args.max_position_embeddings) < 1:
        raise KvtuneError("model sizes must be positive")
    spec = TinyModelSpec(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        dtype=args.dtype,
        seed=args.seed,
    )
    path = write_tiny_model(args.dir, spec)
    print(f"wrote a {spec.num_layers}-layer Llama checkpoint (seed {spec.seed}, {spec.dtype}) to {path}")
    return 0
