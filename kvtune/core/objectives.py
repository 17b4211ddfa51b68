"""The two objectives a policy chooses between, and the rounding it applies, as pure functions over a
what-if table.

- NoPreemption (the default): the largest max_num_seqs predicted to preempt never, with a risk margin —
  its run never held more than (1 - margin) of the pool. That is exact, not a rule of thumb: a run whose
  every step fits in a pool `margin` smaller is step for step the same run in that smaller pool (every
  admission and every new block it got would have been granted there too), so the pick holds with zero
  preemptions even if the pool were that much smaller, or the requests about that much longer, than
  fitted. (With prefix caching the smaller pool would evict cached blocks sooner; the claim is then
  approximate.)
- Goodput: the highest predicted goodput whose p95 queue wait stays within the policy's bound, preempting
  or not (a throughput-first batch tier).

Rounding: vLLM captures CUDA graphs for batch sizes in multiples of 8, and a max_num_seqs that is not
one falls off its captured graphs (vLLM #57355), so on vLLM with CUDA the values are multiples of 8;
elsewhere (kvtune, vLLM on CPU) any value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtune.core.whatif import DEFAULT_RISK_MARGIN, Prediction

CUDA_GRAPH_MULTIPLE = 8


@dataclass(frozen=True)
class Pick:
    """An objective's choice and why, or no choice (`prediction` None) and why not."""

    objective: str  # NoPreemption, Goodput
    prediction: Prediction | None
    reason: str

    @property
    def max_num_seqs(self) -> int | None:
        return self.prediction.candidate.max_num_seqs if self.prediction else None


def default_round_to(engine: str, accelerator: str) -> int:
    """8 for vLLM on CUDA (its captured graphs), 1 elsewhere."""
    return CUDA_GRAPH_MULTIPLE if engine.lower() == "vllm" and accelerator.lower() == "cuda" else 1


def round_down(value: int, round_to: int) -> int:
    """The largest multiple of `round_to` at most `value`, and at least `round_to` itself."""
    if round_to <= 0:
        raise ValueError(f"round_to must be positive, got {round_to}")
    return max(round_to, value // round_to * round_to)


def _eligible(table: Sequence[Prediction], round_to: int) -> list[Prediction]:
    return [p for p in table if p.candidate.max_num_seqs % round_to == 0]


def no_preemption(
    table: Sequence[Prediction], risk_margin: float = DEFAULT_RISK_MARGIN, round_to: int = 1
) -> Pick:
    """The largest max_num_seqs (a multiple of `round_to`) predicted never to preempt, whose run held at
    most 1 - `risk_margin` of the pool; among equal values the higher goodput. Rows are compared as given:
    pass the rows of one pool setting (e.g. `predictions_for(table, fp8=False)`)."""
    if not 0 <= risk_margin < 1:
        raise ValueError(f"the risk margin is a fraction of the pool, 0 to 1, got {risk_margin}")
    rows = _eligible(table, round_to)
    safe = [p for p in rows if p.safe(risk_margin)]
    if not safe:
        return Pick(
            "NoPreemption",
            None,
            f"no candidate kept within {1 - risk_margin:.0%} of the pool without preempting",
        )
    best = max(safe, key=lambda p: (p.candidate.max_num_seqs, p.goodput))
    return Pick(
        "NoPreemption",
        best,
        f"the largest value predicted never to preempt (its run held at most {best.peak_kv_usage:.0%} of the "
        f"pool, margin {risk_margin:.0%})",
    )


def goodput(table: Sequence[Prediction], p95_wait_bound_s: float, round_to: int = 1) -> Pick:
    """The highest predicted goodput among candidates whose p95 queue wait is within the bound (and whose
    queue stays bounded); ties go to the smaller value."""
    rows = [p for p in _eligible(table, round_to) if not p.overloaded]
    within = [p for p in rows if p.p95_queue_wait_s <= p95_wait_bound_s]
    if not within:
        return Pick("Goodput", None, f"no candidate keeps the p95 queue wait within {p95_wait_bound_s:g} s")
    best = max(within, key=lambda p: (p.goodput, -p.candidate.max_num_seqs))
    return Pick(
        "Goodput",
        best,
        f"the highest predicted goodput ({best.goodput:.0f} tokens/s) with p95 queue wait "
        f"{best.p95_queue_wait_s:.2f} s ≤ {p95_wait_bound_s:g} s",
    )
