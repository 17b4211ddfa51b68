"""How long one engine step takes, so that a simulated run's tokens per step become tokens per second.

The model: seconds = per_step + per_sequence × sequences in the batch + per_prefill_token × prompt tokens
computed in the step (prefills and recomputes). It is fitted from operating points — a window's mean
step: its batch (mean running requests), its prefill tokens per step and its seconds per step (the mean
inter-token latency, or the window's span over its steps) — by least squares on relative errors, pulled
towards a prior shape in the directions the points do not pin down.

One window gives one point, which fixes the model's scale but not how the time splits between the step
and its sequences: that split is the prior's (`basis` says so). A second window at another batch size, as
a tuner's verification window is, fixes the split; a third with another prefill load fixes the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The prior's shape, in units of one sequence's decode cost: a step's fixed cost equals that of
# PRIOR_STEP_IN_SEQUENCES sequences, and a prefill token costs PRIOR_PREFILL_TOKEN_IN_SEQUENCES of one.
# Fitted to the static-sweep windows of a first `kvtune bench whatif` run's default and wide-prompts
# workloads on kvtune's tiny CPU engine, in engine CPU-seconds per step (30 windows, batches 4-15: 4.1 ms a
# step, 0.35 ms a sequence, 142 µs a prefill token). The recorded run's windows put the split at 2-45
# sequences a step and 0.04-0.8 a prefill token, workload by workload (BENCHMARKS.md): on a shared machine
# one window pins it loosely, which is why a second window at another batch size refits it. An engine
# whose split differs (vLLM on a GPU, where a step's weight reads dominate) corrects it the same way.
PRIOR_STEP_IN_SEQUENCES = 12.0
PRIOR_PREFILL_TOKEN_IN_SEQUENCES = 0.4
# Points whose batches differ by less than this ratio cannot tell per-step from per-sequence cost.
MIN_BATCH_SPREAD = 1.25
# How strongly the prior holds a direction the points leave free, relative to one point's weight: enough
# to settle a direction no point constrains, too little to bend one the points do (on exact points from a
# model far from the prior, the fit is within 2%).
PRIOR_WEIGHT = 1e-4


@dataclass(frozen=True)
class OperatingPoint:
    """One window's mean step: running sequences, prompt tokens computed per step, seconds per step."""

    batch: float
    prefill_per_step: float
    step_seconds: float


@dataclass(frozen=True)
class StepTimeModel:
    per_step_s: float
    per_sequence_s: float
    per_prefill_token_s: float
    basis: str  # how it was fitted, in words (fitted / shape from the prior)

    def seconds(self, sequences: int, prefill_tokens: int) -> float:
        return self.per_step_s + self.per_sequence_s * sequences + self.per_prefill_token_s * prefill_tokens

    def at(self, point: OperatingPoint) -> float:
        return (
            self.per_step_s
            + self.per_sequence_s * point.batch
            + self.per_prefill_token_s * point.prefill_per_step
        )

    def describe(self) -> str:
        return (
            f"{self.per_step_s * 1e3:.2f} ms/step + {self.per_sequence_s * 1e3:.2f} ms/sequence + "
            f"{self.per_prefill_token_s * 1e6:.1f} µs/prefill token ({self.basis})"
        )


def _features(point: OperatingPoint) -> tuple[float, float, float]:
    return (1.0, point.batch, point.prefill_per_step)


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(vector)
    a = [[*row[:], vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-15:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                for c in range(col, n + 1):
                    a[r][c] -= factor * a[col][c]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit_step_time(
    points: Sequence[OperatingPoint],
    step_in_sequences: float = PRIOR_STEP_IN_SEQUENCES,
    prefill_token_in_sequences: float = PRIOR_PREFILL_TOKEN_IN_SEQUENCES,
) -> StepTimeModel | None:
    """The model that best reproduces `points` (None without a usable point).

    The prior shape is scaled to the points first (the least-squares scale on relative errors); then each
    coefficient c_k minimises Σ_points ((t - Σ c·x) / t)² + PRIOR_WEIGHT·n·Σ_k ((c_k - prior_k) / prior_k)²,
    clamped at zero: with one point this is the scaled prior, with points at several batch sizes the data.
    """
    usable = [p for p in points if p.step_seconds > 0 and p.batch > 0]
    if not usable:
        return None
    shape = (step_in_sequences, 1.0, prefill_token_in_sequences)
    # scale: minimise Σ (1 - s·shape·x / t)² -> s = Σ (shape·x/t) / Σ (shape·x/t)²
    ratios = [sum(c * x for c, x in zip(shape, _features(p), strict=True)) / p.step_seconds for p in usable]
    scale = sum(ratios) / sum(r * r for r in ratios)
    prior = [scale * c for c in shape]
    batches = [p.batch for p in usable]
    spread = max(batches) / min(batches)
    prefill_loads = [p.prefill_per_step / p.batch for p in usable]
    prefill_spread = max(prefill_loads) > 1.25 * min(prefill_loads) + 1e-9
    if len(usable) == 1 or (spread < MIN_BATCH_SPREAD and not prefill_spread):
        return StepTimeModel(
            prior[0], prior[1], prior[2], "scale fitted to 1 operating point; shape from the prior"
        )
    weight = PRIOR_WEIGHT * len(usable)
    active = [0, 1, 2]
    coefficients = prior[:]
    for _ in range(3):  # drop a coefficient that comes out negative and solve again
        matrix = [[0.0] * len(active) for _ in active]
        vector = [0.0] * len(active)
        for p in usable:
            x = _features(p)
            fixed = sum(coefficients[k] * x[k] for k in range(3) if k not in active)
            for i, k in enumerate(active):
                vector[i] += x[k] * (p.step_seconds - fixed) / p.step_seconds**2
                for j, m in enumerate(active):
                    matrix[i][j] += x[k] * x[m] / p.step_seconds**2
        for i, k in enumerate(active):
            matrix[i][i] += weight / prior[k] ** 2
            vector[i] += weight / prior[k]
        solved = _solve(matrix, vector)
        if solved is None:
            break
        for i, k in enumerate(active):
            coefficients[k] = solved[i]
        negative = [k for k in active if coefficients[k] < 0]
        if not negative:
            break
        for k in negative:
            coefficients[k] = 0.0
            active.remove(k)
    basis = f"fitted to {len(usable)} operating points (batches {min(batches):.1f}-{max(batches):.1f})"
    a, b, c = (max(0.0, value) for value in coefficients)
    return StepTimeModel(a, b, c, basis)
