"""Exact merge of attention computed over disjoint key ranges (split-K / flash-decoding).

Each partial carries its normalised output o_i and the log-sum-exp lse_i of its scaled scores. The full
softmax over the union weights each partial by exp(lse_i - lse), where lse = log(sum_i exp(lse_i)), so the
merge is exact up to rounding. An empty range has lse = -inf and weight 0.
"""

from __future__ import annotations

import torch


def merge_attention_partials(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partials `outputs [S, ..., D]` with `lses [S, ...]` over dim 0; return (output, lse)."""
    top = lses.max(dim=0).values
    # Where every partial is empty, subtract 0 instead of -inf so the weights are exp(-inf) = 0, not NaN.
    safe_top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - safe_top.unsqueeze(0))
    total = weights.sum(dim=0)
    merged = (outputs * weights.unsqueeze(-1)).sum(dim=0)
    merged = torch.where(total.unsqueeze(-1) > 0, merged / total.clamp_min(1e-30).unsqueeze(-1), 0.0)
    return merged, safe_top + torch.log(total)
