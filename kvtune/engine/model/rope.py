"""Rotary position embeddings: the frequency table (plain, linear-scaled or llama3-scaled) and its use.

The table is built once in fp32 for every position the model may see; a forward pass only gathers rows by
position, so varlen batches with arbitrary positions cost one index per token.
"""

from __future__ import annotations

import math

import torch

from kvtune.engine.model.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies `[head_dim // 2]` in fp32, after the config's scaling rule.

    llama3 scaling leaves high frequencies (short wavelengths) alone, divides low ones by `factor`, and
    interpolates smoothly in between, so a model stretched to long context keeps its local resolution.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type != "llama3":
        return inv_freq
    original = rope.original_max_position_embeddings
    long_wavelength = original / rope.low_freq_factor
    short_wavelength = original / rope.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = torch.where(wavelength > long_wavelength, inv_freq / rope.factor, inv_freq)
    in_between = (wavelength <= long_wavelength) & (wavelength >= short_wavelength)
    return torch.where(in_between, blended, scaled)


class RotaryTable:
    """cos/sin of every (position, frequency) pair, laid out for the half-split rotation Llama uses."""

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device | str
    ) -> None:
        inv_freq = inverse_frequencies(rope, head_dim).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        angles = torch.outer(positions, inv_freq)
        doubled = torch.cat((angles, angles), dim=-1)
        self.cos = doubled.cos()
        self.sin = doubled.sin()
        self.max_positions = max_positions

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[tokens, 1, head_dim]` for a batch's positions, gathered once for all layers."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[tokens, heads, head_dim]`: pair i is (x[i], x[i + head_dim / 2]), Llama's half-split layout."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
