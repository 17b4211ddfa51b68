"""`kvtune sim --table seed`: every figure the seed states, beside ours.

A row is `simulated` when simulation runs produce it (the mean over several random seeds, since the seed's
own numbers are one random run), or `derived` when it is arithmetic on the seed's own constants (sizes,
the boot line's concurrency): a derived row checks our formulas, not the simulator, so it never counts
toward the claim of how many figures the simulator reproduces. Nothing is written in. Tolerances: 5% for
headline throughput, sequence-count and utilisation figures, 15% for the rest, none for the sizes in the
seed's single fragmentation log line, which are one random draw. The figures we expect to miss are listed
in `EXPECTED_MISSES`, each with its reason; docs/simulator.md only reports them.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Literal

from kvtune.core.accounting import block_table_bytes
from kvtune.core.geometry import GIB, MIB, QWEN3_8B
from kvtune.sim.scenarios import (
    SEED_MAX_MODEL_LEN,
    SEED_POOL_TOKENS,
    SEED_TABLE_MAX_NUM_SEQS,
    seed_config,
    with_seed,
)
from kvtune.sim.simulator import SimConfig, SimResult, simulate

HEADLINE, OTHER = 0.05, 0.15
KERNEL_PENALTY = 0.77  # the seed's 20-26% paged-kernel overhead, applied as a factor
Kind = Literal["simulated", "derived"]


@dataclass(frozen=True)
class ExpectedMiss:
    """A figure outside its tolerance on purpose, and why."""

    figure: str
    reason: str


_UNSTATED_SCHEDULING = (
    "preemptions are rare events (a few dozen in 2,000 steps) and their number depends on scheduling "
    "details the seed does not state: whether a step admits before or after it grows running sequences, "
    "and whether a preempted request may be readmitted in the step that evicted it; we follow vLLM V1 "
    "(running requests first, no admission in a step that preempted)"
)
EXPECTED_MISSES = (
    ExpectedMiss("paged, defaults: preemptions in the window", _UNSTATED_SCHEDULING),
    ExpectedMiss("paged, spread 0: preemptions in the window", _UNSTATED_SCHEDULING),
    ExpectedMiss(
        "paged, spread 0: discarded tokens",
        "a preempted request throws away the tokens it had generated, so this figure rests on which "
        "requests are preempted and how far they had got: " + _UNSTATED_SCHEDULING,
    ),
)
EXPECTED_MISS_FIGURES = frozenset(miss.figure for miss in EXPECTED_MISSES)


@dataclass(frozen=True)
class Figure:
    figure: str
    seed: float
    simulated: float  # ours: from the simulator, or from arithmetic when `kind` is "derived"
    tolerance: float | None
    kind: Kind = "simulated"

    @property
    def relative_error(self) -> float:
        return abs(self.simulated - self.seed) / abs(self.seed) if self.seed else 0.0

    @property
    def within(self) -> bool | None:
        return None if self.tolerance is None else self.relative_error <= self.tolerance + 1e-12

    def to_dict(self) -> dict[str, object]:
        return {
            "figure": self.figure,
            "seed": self.seed,
            "simulated": round(self.simulated, 4),
            "relative_error": round(self.relative_error, 4),
            "tolerance": self.tolerance,
            "kind": self.kind,
        }


def seed_runs(max_tokens: int = 2048) -> dict[str, SimConfig]:
    """The slider positions the seed's text walks through."""
    mt = max_tokens
    return {
        "contiguous": seed_config(policy="contiguous", max_tokens=mt),
        "paged": seed_config(policy="paged", max_tokens=mt),
        "contiguous_16k": seed_config(policy="contiguous", max_tokens=16_384),
        "paged_16k": seed_config(policy="paged", max_tokens=16_384),
        "contiguous_256": seed_config(policy="contiguous", max_tokens=256),
        "oracle_spread100": seed_config(policy="oracle", max_tokens=mt, round_pow2=False, spread=100),
        "oracle_spread0": seed_config(policy="oracle", max_tokens=mt, round_pow2=False, spread=0),
        "paged_spread0": seed_config(policy="paged", max_tokens=mt, spread=0),
        "paged_bs256": seed_config(policy="paged", max_tokens=mt, block_size=256),
        "shared_bs16": seed_config(policy="paged", max_tokens=mt, shared_prefix=1000),
        "shared_bs256": seed_config(policy="paged", max_tokens=mt, shared_prefix=1000, block_size=256),
    }


def _run(job: tuple[str, SimConfig]) -> tuple[str, SimResult]:
    name, cfg = job
    return name, simulate(cfg)


def run_all(runs: dict[str, SimConfig], seeds: int, workers: int | None = None) -> dict[str, list[SimResult]]:
    """Every run for every seed, spread over the machine's cores."""
    jobs = [(name, with_seed(cfg, s)) for name, cfg in runs.items() for s in range(seeds)]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    results: dict[str, list[SimResult]] = {name: [] for name in runs}
    if workers <= 1:
        pairs = map(_run, jobs)
        for name, res in pairs:
            results[name].append(res)
        return results
    with ProcessPoolExecutor(workers) as pool:
        for name, res in pool.map(_run, jobs, chunksize=1):
            results[name].append(res)
    return results


def derived(figure: str, seed: float, ours: float, tolerance: float | None) -> Figure:
    """A row computed from the seed's own constants, not by the simulator."""
    return Figure(figure, seed, ours, tolerance, kind="derived")


def _mean(results: list[SimResult], get: Callable[[SimResult], float]) -> float:
    return statistics.fmean(get(r) for r in results)


def seed_figures(seeds: int = 3, max_tokens: int = 2048, workers: int | None = None) -> list[Figure]:
    """Simulate the seed's runs and line every stated figure up against ours."""
    res = run_all(seed_runs(max_tokens), seeds, workers)

    def m(run: str, get: Callable[[SimResult], float]) -> float:
        return _mean(res[run], get)

    def tps(run: str) -> float:
        return m(run, lambda r: r.tokens_per_step)

    def seqs(run: str) -> float:
        return m(run, lambda r: r.resident_sequences)

    def eff(run: str) -> float:
        return 100 * m(run, lambda r: r.effective_utilization)

    frag = res["oracle_spread100"][0].first_fragmentation
    bytes_per_token = QWEN3_8B.bytes_per_token
    partial_bound_mib = 15 * bytes_per_token / MIB
    F = Figure
    figures = [
        derived(
            "pool: GiB for 405,239 tokens at 144 KiB/token",
            55.65,
            SEED_POOL_TOKENS * bytes_per_token / GIB,
            HEADLINE,
        ),
        derived(
            "boot line: maximum concurrency for 40,960 tokens",
            9.89,
            SEED_POOL_TOKENS / SEED_MAX_MODEL_LEN,
            HEADLINE,
        ),
        F("contiguous, defaults: resident sequences", 44, seqs("contiguous"), HEADLINE),
        F("contiguous, defaults: tokens per step", 43.7, tps("contiguous"), HEADLINE),
        F("contiguous, defaults: effective %", 48, eff("contiguous"), HEADLINE),
        F("paged, defaults: resident sequences", 95, seqs("paged"), HEADLINE),
        F("paged, defaults: tokens per step", 95.4, tps("paged"), HEADLINE),
        F("paged, defaults: effective %", 99.8, eff("paged"), HEADLINE),
        F("paged ÷ contiguous, defaults", 2.2, tps("paged") / tps("contiguous"), HEADLINE),
        F("contiguous, max_tokens 16,384: resident sequences", 12, seqs("contiguous_16k"), HEADLINE),
        F("contiguous, max_tokens 16,384: tokens per step", 12.0, tps("contiguous_16k"), HEADLINE),
        F("contiguous, max_tokens 16,384: effective %", 13.5, eff("contiguous_16k"), HEADLINE),
        F("paged, max_tokens 16,384: tokens per step", 95.4, tps("paged_16k"), HEADLINE),
        F("paged ÷ contiguous, max_tokens 16,384", 7.9, tps("paged_16k") / tps("contiguous_16k"), HEADLINE),
        F("contiguous, max_tokens 256: tokens per step", 60.0, tps("contiguous_256"), HEADLINE),
        F("contiguous, max_tokens 256: effective %", 66, eff("contiguous_256"), HEADLINE),
        F(
            "oracle, spread 100, no rounding: first fragmentation, request #",
            96,
            frag.request if frag else 0,
            None,
        ),
        F("  … slots needed", 2712, frag.slots_needed if frag else 0, None),
        F("  … slots free", 3881, frag.slots_free if frag else 0, None),
        F("  … free runs", 3, frag.free_runs if frag else 0, None),
        F("  … largest run", 1689, frag.largest_run if frag else 0, None),
        F(
            "oracle, spread 100: steps of 3,000 the head was blocked by fragmentation",
            2938,
            m("oracle_spread100", lambda r: r.head_blocked_steps.get("external_fragmentation", 0)),
            OTHER,
        ),
        F("oracle, spread 0, no rounding: tokens per step", 96.7, tps("oracle_spread0"), HEADLINE),
        F("oracle, spread 0, no rounding: effective %", 96.9, eff("oracle_spread0"), HEADLINE),
        F("paged, spread 0: tokens per step", 96.3, tps("paged_spread0"), HEADLINE),
        F("paged, spread 0, × 0.77 kernel penalty", 74.2, KERNEL_PENALTY * tps("paged_spread0"), HEADLINE),
        F("paged, defaults: preemptions in the window", 45, m("paged", lambda r: r.preemptions), OTHER),
        F("paged, defaults: discarded tokens", 120, m("paged", lambda r: r.discarded_tokens), OTHER),
        F("paged, defaults: delivered tokens", 190_800, m("paged", lambda r: r.delivered_tokens), HEADLINE),
        F(
            "paged, spread 0: preemptions in the window",
            83,
            m("paged_spread0", lambda r: r.preemptions),
            OTHER,
        ),
        F("paged, spread 0: discarded tokens", 4917, m("paged_spread0", lambda r: r.discarded_tokens), OTHER),
        F("paged, block size 256: tokens per step", 93.0, tps("paged_bs256"), HEADLINE),
        F(
            "sharing a 1,000-token system prompt, block 16: shared tokens",
            992,
            m("shared_bs16", lambda r: r.shared_tokens_per_request),
            OTHER,
        ),
        F("sharing, block 16: tokens per step", 122.9, tps("shared_bs16"), HEADLINE),
        F(
            "sharing, block 256: shared tokens",
            768,
            m("shared_bs256", lambda r: r.shared_tokens_per_request),
            OTHER,
        ),
        F("sharing, block 256: tokens per step", 112.6, tps("shared_bs256"), HEADLINE),
        F(
            "paged, defaults: held-and-empty MiB (average)",
            101,
            m("paged", lambda r: r.held_and_empty_mib),
            OTHER,
        ),
        derived("paged: one partial block's bound, MiB (15 slots)", 2.11, partial_bound_mib, OTHER),
        F("paged: bound across the resident sequences, MiB", 200, partial_bound_mib * seqs("paged"), OTHER),
        derived(
            "block table MiB, block 16 (128 seqs × 40,960 tokens)",
            1.25,
            block_table_bytes(SEED_TABLE_MAX_NUM_SEQS, SEED_MAX_MODEL_LEN, 16) / MIB,
            HEADLINE,
        ),
        derived(
            "block table MiB, block 1",
            20,
            block_table_bytes(SEED_TABLE_MAX_NUM_SEQS, SEED_MAX_MODEL_LEN, 1) / MIB,
            HEADLINE,
        ),
    ]
    return figures


def _verdict(figure: Figure) -> str:
    if figure.within is None:
        return "shown"
    if figure.within:
        return "ok"
    return f"> {figure.tolerance:.0%}" + (", expected" if figure.figure in EXPECTED_MISS_FIGURES else "")


def headline_claim(figures: list[Figure]) -> str:
    """The claim the table supports: how many simulated figures fall within their tolerance. Derived rows
    are counted apart, so arithmetic on the seed's constants never inflates it."""
    simulated = [f for f in figures if f.kind == "simulated"]
    headline = [f for f in simulated if f.tolerance == HEADLINE]
    others = [f for f in simulated if f.tolerance == OTHER]
    misses_expected = sum(1 for f in simulated if f.within is False and f.figure in EXPECTED_MISS_FIGURES)
    shown = sum(1 for f in simulated if f.tolerance is None)
    derived_rows = [f for f in figures if f.kind == "derived"]

    def within(rows: list[Figure]) -> int:
        return sum(1 for f in rows if f.within)

    return "\n".join(
        [
            f"simulated: {within(headline)} of {len(headline)} headline figures within {HEADLINE:.0%}, "
            f"{within(others)} of {len(others)} others within {OTHER:.0%} "
            f"({misses_expected} expected misses, see docs/simulator.md); {shown} figures of the fragmentation log line shown, not compared",
            f"derived from the seed's constants, not counted above: {within(derived_rows)} of "
            f"{len(derived_rows)} within their tolerance",
        ]
    )


def format_table(figures: list[Figure]) -> str:
    """A plain-text table a person reads: figure, the seed's value, ours, the error, the row's kind and
    the verdict; then the headline claim."""
    width = max(len(f.figure) for f in figures)
    lines = [f"{'figure':<{width}}  {'seed':>10}  {'ours':>10}  {'error':>7}  {'kind':<9}  check"]
    for f in figures:
        lines.append(
            f"{f.figure:<{width}}  {f.seed:>10,.6g}  {f.simulated:>10,.6g}  {f.relative_error:>6.1%}  "
            f"{f.kind:<9}  {_verdict(f)}"
        )
    return "\n".join([*lines, "", headline_claim(figures)])
