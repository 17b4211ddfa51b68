"""The cap's decision table: no cap, a default, under the cap, clamp and reject."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune.front.max_tokens_cap import apply_max_tokens_cap


def test_no_cap_leaves_the_request_alone() -> None:
    assert apply_max_tokens_cap(5000, None, "clamp").max_tokens == 5000
    assert apply_max_tokens_cap(None, None, "reject").max_tokens is None


def test_the_cap_is_the_default_when_max_tokens_is_absent() -> None:
    decision = apply_max_tokens_cap(None, 256, "reject")
    assert (decision.max_tokens, decision.counted_as, decision.error) == (256, "default", None)
    assert decision.header == "defaulted to 256"


def test_clamp_lowers_and_says_so() -> None:
    decision = apply_max_tokens_cap(4096, 256, "clamp")
    assert (decision.max_tokens, decision.counted_as) == (256, "clamp")
    assert decision.header == "capped from 4096 to 256"


def test_reject_names_the_cap() -> None:
    decision = apply_max_tokens_cap(4096, 256, "reject")
    assert decision.counted_as == "reject"
    assert decision.error is not None and "4096" in decision.error and "256" in decision.error


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="clamp, reject"):
        apply_max_tokens_cap(1, 1, "drop")  # type: ignore[arg-type]


@given(st.integers(1, 10_000), st.integers(1, 10_000), st.sampled_from(["clamp", "reject"]))
def test_whatever_runs_stays_within_the_cap(requested: int, cap: int, mode: str) -> None:
    decision = apply_max_tokens_cap(requested, cap, mode)  # type: ignore[arg-type]
    if decision.error is None:
        assert decision.max_tokens is not None and decision.max_tokens <= cap
        assert decision.max_tokens == min(requested, cap)
    else:
        assert requested > cap and mode == "reject"
