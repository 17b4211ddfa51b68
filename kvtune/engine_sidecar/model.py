"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat varlen batch and the paged KV cache.

Parameter names mirror the Hugging Face checkpoint layout (`model.layers.N.self_attn.q_proj.weight`, ...)
so loading is a name-for-name copy. Attention never sees padding: new K/V go to their slots through
`write_kv`, then decodes and prefill chunks read the cache through kvtune.kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvtune.engine_sidecar.attention_metadata import AttentionMetadata
from kvtune.engine_sidecar.checkpoint import open_checkpoint
from kvtune.engine_sidecar.config import ModelConfig
from kvtune.engine_sidecar.kv_cache import KVCache
from kvtune.engine_sidecar.rope import RotaryTable
from kvtune.kernels import paged_decode_attention, paged_prefill_attention, write_kv


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (16-bit sums of squares lose the small components)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _linear(rows: int, cols: int, bias: bool) -> nn.Linear:
    """`rows x cols` weight as stored in checkpoints (out_features first)."""
    return nn.Linear(cols, rows, bias=bias)


class Attention(nn.Module):
    """Grouped-query self-attention: project, optional per-head q/k norm, RoPE, cache write, paged attention."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.q_proj = _linear(config.num_heads * config.head_dim, config.hidden_size, config.qkv_bias)
        self.k_proj = _linear(config.num_kv_heads * config.head_dim, config.hidden_size, config.qkv_bias)
        self.v_proj = _linear(config.num_kv_heads * config.head_dim, config.hidden_size, config.qkv_bias)
        self.o_proj = _linear(config.hidden_size, config.num_heads * config.head_dim, config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTable,
        metadata: AttentionMetadata,
        cache: KVCache,
        backend: str | None,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = rotary.rotate(q, positions)
        k = rotary.rotate(k, positions)
        layer_cache = cache.layers[self.layer_index]
        write_kv(layer_cache, k, v, metadata.slot_mapping, cache.k_scale, cache.v_scale, backend=backend)
        out = torch.empty_like(q)
        decodes = metadata.num_decodes
        if decodes:
            out[:decodes] = paged_decode_attention(
                q[:decodes],
                layer_cache,
                metadata.block_tables[:decodes],
                metadata.seq_lens[:decodes],
                self.scale,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
                backend=backend,
            )
        if decodes < metadata.num_seqs:
            out[decodes:] = paged_prefill_attention(
                q[decodes:],
                layer_cache,
                metadata.block_tables[decodes:],
                metadata.prefill_query_start_loc,
                metadata.seq_lens[decodes:],
                self.scale,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
                backend=backend,
            )
        projected: torch.Tensor = self.o_proj(out.view(tokens, self.num_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = _linear(config.intermediate_size, config.hidden_size, config.mlp_bias)
        self.up_proj = _linear(config.intermediate_size, config.hidden_size, config.mlp_bias)
        self.down_proj = _linear(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTable,
        metadata: AttentionMetadata,
        cache: KVCache,
        backend: str | None,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), positions, rotary, metadata, cache, backend
        )
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + mlp_out


class DecoderStack(nn.Module):
    """Embeddings, layers and final norm: the `model.` prefix of the checkpoint."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus its output head; `forward` runs one engine step over the paged cache.

    Built on the meta device (no storage, no random init): `materialise` adopts the checkpoint's tensors.
    """

    def __init__(self, config: ModelConfig, attention_backend: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        with torch.device("meta"):
            self.model = DecoderStack(config)
            self.lm_head = _linear(config.vocab_size, config.hidden_size, False)
        self.rotary: RotaryTable | None = None

    def checkpoint_tensor_names(self) -> list[str]:
        """Tensors this model reads from a checkpoint (a tied head reads the embedding instead)."""
        names = list(self.state_dict(keep_vars=True))
        if self.config.tie_word_embeddings:
            names.remove("lm_head.weight")
        return names

    def materialise(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the checkpoint's tensors as parameters and build the RoPE table on their device."""
        self.load_state_dict(tensors, strict=not self.config.tie_word_embeddings, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        device = self.model.embed_tokens.weight.device
        self.rotary = RotaryTable(
            self.config.rope, self.config.head_dim, self.config.max_position_embeddings, device
        )
        self.requires_grad_(False)
        self.eval()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        cache: KVCache,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Logits `[num_seqs, vocab]` for each sequence's last new token, or `[num_tokens, vocab]` if
        `all_logits`. Writes every new token's K/V into `cache` as a side effect."""
        assert self.rotary is not None, "materialise() loads the weights first"
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, positions, self.rotary, metadata, cache, self.attention_backend)
        if not all_logits:
            hidden = hidden[metadata.last_token_rows]
        logits: torch.Tensor = self.lm_head(self.model.norm(hidden))
        return logits


def load_model(
    folder: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    attention_backend: str | None = None,
) -> CausalLM:
    """Load a checkpoint folder into a ready model, in `dtype` (default: the checkpoint's) on `device`."""
    checkpoint = open_checkpoint(folder)
    model = CausalLM(checkpoint.config, attention_backend)
    tensors = checkpoint.load_tensors(
        model.checkpoint_tensor_names(), dtype or checkpoint.config.dtype, device
    )
    model.materialise(tensors)
    return model
