"""The sampler returns a valid token id, and never raises, for every parameter `validate` accepts and for any
logits a model can produce (NaN, +-inf, huge or subnormal values): the fuzz that found top_p=1e-46
underflowing to an empty distribution, as a property."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtune.engine.model.sampling import MIN_TOP_P, Sampler, SamplingParams, sample_row

VOCAB = 64

temperatures = st.one_of(
    st.floats(min_value=0.0, max_value=100.0, allow_subnormal=True),
    st.sampled_from([0.0, 5e-324, 1e-300, 1e-45, 1e-6, 1e-5, 1.0000001e-5, 1.0, 99.999, 100.0]),
)
top_ps = st.one_of(
    st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_subnormal=True),
    st.sampled_from([5e-324, 1e-46, 7e-46, 1e-45, 1e-38, 1e-9, 0.5, 0.9999999, 1.0]),
)
top_ks = st.one_of(st.just(-1), st.integers(min_value=1, max_value=2 * VOCAB), st.just(10**30))
logit_values = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-45, 0.0]),
)
logit_rows = st.one_of(
    st.lists(logit_values, min_size=VOCAB, max_size=VOCAB),
    st.lists(st.floats(min_value=-30, max_value=30, width=32), min_size=VOCAB, max_size=VOCAB),
    st.sampled_from([[float("nan")] * VOCAB, [float("-inf")] * VOCAB, [float("inf")] * VOCAB, [0.0] * VOCAB]),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    row=logit_rows,
    temperature=temperatures,
    top_p=top_ps,
    top_k=top_ks,
    seed=st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**63 - 1)),
)
@example(row=[0.0] * VOCAB, temperature=1.0, top_p=1e-46, top_k=-1, seed=None)
@example(row=[0.0] * VOCAB, temperature=1.0, top_p=5e-324, top_k=-1, seed=0)
def test_every_accepted_parameter_samples_a_valid_token(
    row: list[float], temperature: float, top_p: float, top_k: int, seed: int | None
) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    params.validate(vocab_size=VOCAB)
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    logits = torch.tensor([row, list(reversed(row))], dtype=torch.float32)
    tokens = Sampler().sample(logits, [params, params], [generator, generator])
    for token in tokens:
        assert isinstance(token, int) and 0 <= token < VOCAB, token


@pytest.mark.parametrize("top_p", [1e-46, 7e-46, 5e-324, 1e-12])
def test_a_vanishing_top_p_keeps_exactly_the_best_token(top_p: float) -> None:
    """The fuzz case: top_p rounds to 0 in float32 and used to mask every token (multinomial raised)."""
    params = SamplingParams(temperature=1.0, top_p=top_p)
    params.validate(vocab_size=VOCAB)
    assert params.top_p == MIN_TOP_P
    logits = torch.linspace(-3, 3, VOCAB).roll(17)
    for seed in range(20):
        assert sample_row(logits, params, torch.Generator().manual_seed(seed)) == int(logits.argmax())


def test_validate_normalises_a_top_k_covering_the_vocabulary() -> None:
    params = SamplingParams(top_k=10**30)
    params.validate(vocab_size=VOCAB)
    assert params.top_k == -1
    kept = SamplingParams(top_k=VOCAB - 1)
    kept.validate(vocab_size=VOCAB)
    assert kept.top_k == VOCAB - 1


def test_nan_logits_are_impossible_tokens_not_a_broken_distribution() -> None:
    logits = torch.full((VOCAB,), float("nan"))
    logits[5] = -2.0
    logits[9] = -1.0
    params = SamplingParams(temperature=100.0)
    drawn = {sample_row(logits, params, torch.Generator().manual_seed(s)) for s in range(50)}
    assert drawn <= {5, 9} and drawn  # only the finite tokens can come out


def test_filtering_still_follows_the_distribution() -> None:
    """Log-space sampling is the same distribution as softmax(logits / T): a cheap chi-square-free check."""
    logits = torch.tensor([2.0, 1.0, 0.0, -50.0])
    params = SamplingParams(temperature=1.0, top_k=3)
    generator = torch.Generator().manual_seed(1)
    draws = [sample_row(logits, params, generator) for _ in range(4000)]
    expected = torch.softmax(logits[:3], dim=-1).tolist()
    for token, p in enumerate(expected):
        assert math.isclose(draws.count(token) / len(draws), p, abs_tol=0.03)
    assert 3 not in draws


def test_one_failing_row_fails_alone_and_leaves_the_other_generators_untouched() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(seed=1), SamplingParams(seed=2), SamplingParams(seed=3)]
    fresh = [torch.Generator().manual_seed(p.seed or 0) for p in params]
    clean = Sampler().sample(logits, params, list(fresh))

    class FailsOnRowTwo(Sampler):
        def sample_row(self, logits: torch.Tensor, p: SamplingParams, g: torch.Generator | None) -> int:
            if p.seed == 2:
                raise RuntimeError("row two is broken")
            return super().sample_row(logits, p, g)

    generators = [torch.Generator().manual_seed(p.seed or 0) for p in params]
    result = FailsOnRowTwo().sample(logits, params, list(generators))
    assert isinstance(result[1], RuntimeError)
    assert [result[0], result[2]] == [clean[0], clean[2]]
