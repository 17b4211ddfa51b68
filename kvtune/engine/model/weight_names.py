"""Map the model's fused parameters to the checkpoint's separate tensors and back.

Checkpoints store q_proj, k_proj, v_proj (and gate_proj, up_proj) apart; the model multiplies by their
row-wise concatenation. Keeping the table here means the model and the loader cannot disagree on order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# fused module name -> the checkpoint's modules, in the order their rows are stacked
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _parts(parameter: str) -> list[str]:
    """Checkpoint tensors that make up `parameter` (itself, unless it belongs to a fused module)."""
    prefix, _, leaf = parameter.rpartition(".")
    for fused, pieces in FUSED_MODULES.items():
        if prefix == fused or prefix.endswith("." + fused):
            base = prefix[: len(prefix) - len(fused)]
            return [f"{base}{piece}.{leaf}" for piece in pieces]
    return [parameter]


def checkpoint_names(parameters: Iterable[str]) -> list[str]:
    """The checkpoint tensor names that `parameters` are built from."""
    return [name for parameter in parameters for name in _parts(parameter)]


def gather_parameters(parameters: Iterable[str], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's value: its checkpoint tensor, or its pieces stacked row-wise."""
    gathered = {}
    for parameter in parameters:
        parts = _parts(parameter)
        gathered[parameter] = tensors[parts[0]] if len(parts) == 1 else torch.cat([tensors[p] for p in parts])
    return gathered
