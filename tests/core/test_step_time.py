"""The step-time model: one operating point fixes its scale, points at several batch sizes its split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.core.step_time import (
    PRIOR_PREFILL_TOKEN_IN_SEQUENCES,
    PRIOR_STEP_IN_SEQUENCES,
    OperatingPoint,
    StepTimeModel,
    fit_step_time,
)


def test_one_point_is_reproduced_exactly_with_the_prior_shape() -> None:
    point = OperatingPoint(batch=10.0, prefill_per_step=40.0, step_seconds=0.02)
    model = fit_step_time([point])
    assert model is not None
    assert model.at(point) == pytest.approx(0.02)
    assert model.per_step_s / model.per_sequence_s == pytest.approx(PRIOR_STEP_IN_SEQUENCES)
    assert model.per_prefill_token_s / model.per_sequence_s == pytest.approx(PRIOR_PREFILL_TOKEN_IN_SEQUENCES)
    assert "prior" in model.basis


@settings(max_examples=40, deadline=None)
@given(
    per_step=st.floats(1e-3, 2e-2),
    per_sequence=st.floats(1e-4, 3e-3),
    per_token=st.floats(1e-6, 3e-4),
)
def test_points_spread_over_batch_and_prefill_recover_the_true_model(
    per_step: float, per_sequence: float, per_token: float
) -> None:
    truth = StepTimeModel(per_step, per_sequence, per_token, "truth")
    points = [
        OperatingPoint(batch, prefill, 0.0)
        for batch, prefill in ((2, 10), (4, 60), (8, 20), (12, 200), (16, 90), (24, 400))
    ]
    points = [OperatingPoint(p.batch, p.prefill_per_step, truth.at(p)) for p in points]
    model = fit_step_time(points)
    assert model is not None and "6 operating points" in model.basis
    for p in points:  # within a few percent everywhere the points are (the prior pulls a little)
        assert model.at(p) == pytest.approx(truth.at(p), rel=0.05)
    far = OperatingPoint(32, 100, 0.0)
    assert model.at(far) == pytest.approx(truth.at(far), rel=0.1)


def test_a_second_window_at_another_batch_corrects_a_wrong_prior_split() -> None:
    truth = StepTimeModel(0.010, 0.0005, 0.0, "truth")  # a step's fixed cost is 20 sequences here
    points = [OperatingPoint(b, 0.0, truth.at(OperatingPoint(b, 0.0, 0.0))) for b in (4.0, 12.0)]
    one = fit_step_time(points[:1])
    two = fit_step_time(points)
    assert one is not None and two is not None
    at_16 = OperatingPoint(16, 0.0, 0.0)
    assert abs(two.at(at_16) / truth.at(at_16) - 1) < abs(one.at(at_16) / truth.at(at_16) - 1)
    assert two.at(at_16) == pytest.approx(truth.at(at_16), rel=0.05)


def test_no_usable_point_fits_nothing_and_coefficients_never_go_negative() -> None:
    assert fit_step_time([]) is None
    assert fit_step_time([OperatingPoint(0.0, 0.0, 0.01)]) is None
    # steps that get cheaper as the batch grows: no negative per-sequence cost, the fit clamps at zero
    model = fit_step_time(
        [OperatingPoint(2, 0, 0.03), OperatingPoint(16, 0, 0.01), OperatingPoint(8, 0, 0.02)]
    )
    assert model is not None
    assert min(model.per_step_s, model.per_sequence_s, model.per_prefill_token_s) >= 0
