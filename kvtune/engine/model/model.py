"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat varlen batch and the paged KV cache.

Attention never sees padding: new K/V go to their slots through the backend's `write_kv`, then decodes and
prefill chunks read the cache through its kernels. The backend is resolved once, at load, and called
directly: the batch builder has checked the step's lengths on the host, so no layer looks a backend up,
re-validates, or reads a length back from the device. q/k/v and gate/up are each one fused matmul (one pass over the
activations instead of three or two); `weight_names` maps them back to the checkpoint's separate tensors.
On a CPU the small ops between them run fused (kvtune.kernels.model_ops: residual add + RMSNorm, RoPE + the
KV write, SiLU-and-multiply), resolved once at load like the backend; elsewhere, the torch code below.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvtune.engine.model.attention_metadata import AttentionMetadata
from kvtune.engine.model.checkpoint import open_checkpoint
from kvtune.engine.model.kv_cache import KVCache
from kvtune.engine.model.model_config import ModelConfig
from kvtune.engine.model.rope import RotaryTable, apply_rotary
from kvtune.engine.model.weight_names import checkpoint_names, gather_parameters
from kvtune.kernels.backends import Backend, resolve_backend
from kvtune.kernels.model_ops import FusedOps, fused_ops


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


class StepContext:
    """What every layer of one forward pass shares: positions' rotary angles, metadata, cache, backend, and
    the fused CPU ops (None: the torch code)."""

    def __init__(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        cache: KVCache,
        backend: Backend,
        fused: FusedOps | None = None,
    ) -> None:
        self.cos = cos
        self.sin = sin
        self.metadata = metadata
        self.cache = cache
        self.backend = backend
        self.fused = fused


class Attention(nn.Module):
    """Grouped-query self-attention: project, optional per-head q/k norm, RoPE, cache write, paged attention."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = _linear(self.q_size + 2 * self.kv_size, config.hidden_size, config.qkv_bias)
        self.o_proj = _linear(config.hidden_size, self.q_size, config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        cache, metadata = step.cache, step.metadata
        layer_cache = cache.layers[self.layer_index]
        backend = step.backend
        fused = step.fused
        # the fused write reproduces the CPU kernels' cache write; another backend (the reference, a test's
        # recording one) keeps its own write_kv
        if (
            fused is not None
            and backend.name == "cpu"
            and self.q_norm is None
            and fused.fits_cache(layer_cache)
        ):
            q = fused.rope_write(
                qkv, step.cos, step.sin, metadata.slot_mapping, layer_cache,
                self.num_heads, self.num_kv_heads, self.head_dim,
            )  # fmt: skip
        else:
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q = q.view(tokens, self.num_heads, self.head_dim)
            k = k.view(tokens, self.num_kv_heads, self.head_dim)
            v = v.contiguous().view(tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q = apply_rotary(q, step.cos, step.sin)
            k = apply_rotary(k, step.cos, step.sin)
            backend.write_kv(layer_cache, k, v, metadata.slot_mapping, cache.k_scale, cache.v_scale)
        decodes = metadata.num_decodes
        if decodes == metadata.num_seqs:  # a decode-only step (most steps): the kernel's output is the output
            out = self._decode(q, step)
        elif decodes == 0:
            out = self._prefill(q, step)
        else:
            out = torch.empty_like(q)
            out[:decodes] = self._decode(q[:decodes], step)
            out[decodes:] = self._prefill(q[decodes:], step)
        projected: torch.Tensor = self.o_proj(out.reshape(tokens, self.q_size))
        return projected

    def _decode(self, q: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The decode kernel over the step's leading one-token sequences (q holds their rows)."""
        metadata, cache = step.metadata, step.cache
        decodes = metadata.num_decodes
        return step.backend.decode(
            q,
            cache.layers[self.layer_index],
            metadata.block_tables[:decodes],
            metadata.seq_lens[:decodes],
            self.scale,
            cache.k_scale,
            cache.v_scale,
            None,
        )

    def _prefill(self, q: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The prefill kernel over the step's chunks after the decodes (q holds their rows)."""
        metadata, cache = step.metadata, step.cache
        decodes = metadata.num_decodes
        return step.backend.prefill(
            q,
            cache.layers[self.layer_index],
            metadata.block_tables[decodes:],
            metadata.prefill_query_start_loc,
            metadata.seq_lens[decodes:],
            self.scale,
            cache.k_scale,
            cache.v_scale,
            max_query_len=metadata.max_prefill_query_len,
        )


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up as one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _linear(2 * config.intermediate_size, config.hidden_size, config.mlp_bias)
        self.down_proj = _linear(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, x: torch.Tensor, fused: FusedOps | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused is not None:
            down: torch.Tensor = self.down_proj(fused.silu_mul(gate_up))
            return down
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        down = self.down_proj(F.silu(gate) * up)
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
        self, hidden: torch.Tensor, step: StepContext, pending: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual stream, MLP output not yet added to it). With the fused ops, the previous layer's MLP
        output arrives as `pending` and is added inside this layer's first norm (one pass, the same rounding
        as the add on its own); the torch code adds it at once and passes None."""
        fused = step.fused
        if fused is None:
            attended: torch.Tensor = self.self_attn(self.input_layernorm(hidden), step)
            hidden = hidden + attended
            mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(hidden))
            return hidden + mlp_out, None
        norm, post = self.input_layernorm, self.post_attention_layernorm
        if pending is None:
            normed = fused.rms_norm(hidden, norm.weight, norm.eps)
        else:
            hidden, normed = fused.add_rms_norm(hidden, pending, norm.weight, norm.eps)
        attended = self.self_attn(normed, step)
        hidden, normed = fused.add_rms_norm(hidden, attended, post.weight, post.eps)
        return hidden, self.mlp(normed, fused)


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

    def __init__(self, config: ModelConfig, attention_backend: Backend) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        with torch.device("meta"):
            self.model = DecoderStack(config)
            self.lm_head = _linear(config.vocab_size, config.hidden_size, False)
        self.rotary: RotaryTable | None = None
        self.fused: FusedOps | None = None  # set by materialise where the device and dtype allow

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def parameter_names(self) -> list[str]:
        """This model's own parameter names (fused projections; a tied head is the embedding itself)."""
        names = list(self.state_dict(keep_vars=True))
        if self.config.tie_word_embeddings:
            names.remove("lm_head.weight")
        return names

    def checkpoint_tensor_names(self) -> list[str]:
        """The checkpoint tensors this model reads."""
        return checkpoint_names(self.parameter_names())

    def materialise(self, tensors: dict[str, torch.Tensor]) -> None:
        """Adopt the checkpoint's tensors (fusing q/k/v and gate/up) and build the RoPE table beside them."""
        parameters = gather_parameters(self.parameter_names(), tensors)
        self.load_state_dict(parameters, strict=not self.config.tie_word_embeddings, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryTable(
            self.config.rope, self.config.head_dim, self.config.max_position_embeddings, self.device
        )
        self.fused = fused_ops(self.device, self.dtype)
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
        cos, sin = self.rotary.angles(positions, self.dtype)
        step = StepContext(cos, sin, metadata, cache, self.attention_backend, self.fused)
        hidden = self.model.embed_tokens(input_ids)
        pending: torch.Tensor | None = None
        for layer in self.model.layers:
            hidden, pending = layer(hidden, step, pending)
        if not all_logits:
            rows = metadata.last_token_rows
            hidden = hidden[rows]
            pending = None if pending is None else pending[rows]
        norm = self.model.norm
        if self.fused is None:
            normed = norm(hidden)
        elif pending is None:
            normed = self.fused.rms_norm(hidden, norm.weight, norm.eps)
        else:
            normed = self.fused.add_rms_norm(hidden, pending, norm.weight, norm.eps)[1]
        logits: torch.Tensor = self.lm_head(normed)
        return logits


def load_model(
    folder: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    attention_backend: str | None = None,
) -> CausalLM:
    """Load a checkpoint folder into a ready model, in `dtype` (default: the checkpoint's) on `device`,
    with attention backend `attention_backend` (default: the device's best) resolved once, here."""
    checkpoint = open_checkpoint(folder)
    model = CausalLM(checkpoint.config, resolve_backend(attention_backend, device))
    tensors = checkpoint.load_tensors(
        model.checkpoint_tensor_names(), dtype or checkpoint.config.dtype, device
    )
    model.materialise(tensors)
    return model
