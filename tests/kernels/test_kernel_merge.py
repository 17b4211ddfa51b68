"""The log-sum-exp merge on its own: attention over split key ranges merges to attention over all keys."""

from __future__ import annotations

import itertools

import torch

from kvtune.kernels import merge_attention_partials


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = q @ k.T
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def test_merge_of_split_ranges_equals_full_softmax():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(50, 16, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(50, 16, generator=gen, dtype=torch.float64)
    bounds = [0, 7, 8, 31, 50]
    parts = [_attend(q, k[a:b], v[a:b]) for a, b in itertools.pairwise(bounds)]
    merged, lse = merge_attention_partials(
        torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    )
    full, full_lse = _attend(q, k, v)
    torch.testing.assert_close(merged, full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=1e-12)


def test_empty_partials_carry_no_weight():
    out = torch.tensor([[[1.0, 2.0]], [[9.0, 9.0]]])
    lse = torch.tensor([[0.5], [float("-inf")]])
    merged, merged_lse = merge_attention_partials(out, lse)
    torch.testing.assert_close(merged, torch.tensor([[1.0, 2.0]]))
    torch.testing.assert_close(merged_lse, torch.tensor([0.5]))


def test_all_empty_merges_to_zero_without_nan():
    out = torch.full((2, 1, 4), float("nan"))
    lse = torch.full((2, 1), float("-inf"))
    merged, merged_lse = merge_attention_partials(out, lse)
    assert torch.equal(merged, torch.zeros(1, 4))
    assert merged_lse.item() == float("-inf")
