"""What-if: replay a fitted workload through the engine's own scheduler and allocator under candidate
settings, and predict each one's preemptions per minute, goodput and p95 queue wait.

The same `Scheduler` and `PagedAllocator` the engine runs (recompute keeping the output, as the engine
and vLLM do); a counting stub for the model (every running request whose tokens are all computed samples
one token per step); a clock that advances each step by the fitted step-time model of what the step ran,
so tokens per step become tokens per second. A closed loop's finished request is replaced by its client's
next one at once; an open loop's requests arrive as a Poisson stream at the fitted rate.

Candidates share random numbers: the i-th request of every run has the same prompt and output length, so
two candidates differ by their settings, not by their draws. A run is deterministic given its seed.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from kvtune.core.allocators import PagedAllocator
from kvtune.core.geometry import DTYPE_BYTES
from kvtune.core.request import Request
from kvtune.core.scheduler import Scheduler, SchedulerConfig
from kvtune.core.step_time import StepTimeModel
from kvtune.core.workload_fit import FittedWorkload

_UNIQUE_BASE = 1 << 24  # request r's own token ids start at (r + 1) << 24: no accidental prefix sharing
FP8_BYTES = 1
# NoPreemption's least margin: the pick's run held at most 98% of the pool (the fit's own uncertainty can
# ask for more: `kvtune.core.predict.Objective.for_fit`)
DEFAULT_RISK_MARGIN = 0.02
EDGE_SEEDS = 4  # seeds pooled at the NoPreemption edge


@dataclass(frozen=True)
class Candidate:
    """One setting to try; None keeps what the engine runs now."""

    max_num_seqs: int
    fp8: bool = False
    block_size: int | None = None
    max_tokens_cap: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")

    def describe(self) -> str:
        parts = [f"max_num_seqs {self.max_num_seqs}"]
        if self.fp8:
            parts.append("FP8 KV")
        if self.block_size is not None:
            parts.append(f"block {self.block_size}")
        if self.max_tokens_cap is not None:
            parts.append(f"cap {self.max_tokens_cap}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Horizon:
    """How long each candidate runs, in steps, from the fitted mean output (one request's life in steps):
    a warm-up that forgets the synchronised start, then the measured span: `measured_lifetimes` lives,
    or fewer (down to `min_measured_lifetimes`) when that many lives would finish more than
    `measured_requests` requests (max_num_seqs of them finish per life)."""

    warmup_lifetimes: float = 1.5
    measured_lifetimes: float = 8.0
    min_measured_lifetimes: float = 4.0
    measured_requests: int = 100
    min_measured_steps: int = 400
    max_measured_steps: int = 4000
    max_waiting: int = 4096  # an open loop beyond the engine's capacity: the queue stops growing here

    def steps(self, mean_output: float, max_num_seqs: int = 1) -> tuple[int, int]:
        lives = min(
            self.measured_lifetimes, max(self.min_measured_lifetimes, self.measured_requests / max_num_seqs)
        )
        measured = round(lives * mean_output)
        measured = min(self.max_measured_steps, max(self.min_measured_steps, measured))
        return round(self.warmup_lifetimes * mean_output), measured


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    preemptions: int  # in the measured span
    preemptions_per_min: float
    goodput: float  # generated tokens per second (the engine's generation-tokens counter)
    p95_queue_wait_s: float  # first admission minus arrival, vLLM's request_queue_time
    running_mean: float
    # the highest share of the pool held at any step of the run, warm-up included: a run that never held
    # more than this is the same run in a pool this much smaller (see objectives.no_preemption)
    peak_kv_usage: float
    simulated_s: float
    finished: int
    overloaded: bool = False  # an open loop whose queue reached Horizon.max_waiting
    # what held admission back at some step of the run (warm-up included): max_num_seqs, memory (a full
    # pool, or a preemption); a run bound by neither is the same run for any larger value of either
    seqs_bound: bool = True
    memory_bound: bool = True
    raw_preemptions_per_min: float = 0.0  # this run's own rate; `preemptions_per_min` may be smoothed
    # what the measured span ran, whatever a step costs: steps, sequences summed over steps, prompt tokens
    # computed (prefills and recomputes) and tokens sampled; a closed loop's goodput under another
    # step-time model is `goodput_under` these, without running again
    steps: int = 0
    sequence_steps: int = 0
    prefill_tokens: int = 0
    tokens: int = 0
    # the measured steps (from 0) at which preemptions happened: they come in bursts, which a rate hides
    preemption_steps: tuple[int, ...] = ()
    seeds: int = 1  # runs pooled into this prediction (their spans one after another)

    @property
    def preempts(self) -> bool:
        return self.preemptions > 0

    def safe(self, risk_margin: float) -> bool:
        """Predicted never to preempt, with the run never holding more than 1 - `risk_margin` of the pool
        (so that the same run would fit a pool that much smaller: objectives.no_preemption)."""
        return self.preemptions_per_min == 0 and self.peak_kv_usage <= 1 - risk_margin

    def chance_of_preemption(self, window_steps: float) -> float:
        """The chance that a window of `window_steps` steps sees at least one preemption: the share of the
        measured span's windows of that length that held one (bursts make it lower than the rate says).
        A window longer than the span is extrapolated at the span's rate."""
        span, width = self.steps, max(1, math.ceil(window_steps))
        if not self.preemption_steps:
            return 0.0
        if width > span:
            return 1.0 - math.exp(-len(self.preemption_steps) / span * width)
        positions = span - width + 1
        edges = [-1, *sorted(set(self.preemption_steps)), span]
        clear = sum(max(0, after - before - 1 - width + 1) for before, after in itertools.pairwise(edges))
        return 1.0 - clear / positions

    def goodput_under(self, model: StepTimeModel) -> float:
        """Tokens per second had each step cost what `model` says (exact for a closed loop, whose steps do
        not depend on the clock; an open loop's arrivals do)."""
        seconds = (
            model.per_step_s * self.steps
            + model.per_sequence_s * self.sequence_steps
            + model.per_prefill_token_s * self.prefill_tokens
        )
        return self.tokens / seconds if seconds > 0 else 0.0


def fp8_pool_factor(cache_dtype: str) -> float:
    """How many times more tokens the same bytes hold in FP8: 2 from a 16-bit cache (and from `auto`, the
    model's dtype, which serving runs in 16 bits), 1 when the cache already is FP8."""
    size = DTYPE_BYTES.get(cache_dtype, 2)
    return size / FP8_BYTES


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Requests:
    """The workload's request stream: the i-th request is the same for every candidate of one seed."""

    def __init__(self, fit: FittedWorkload, seed: int, cap: int | None, pool_tokens: int, block_size: int):
        self.fit = fit
        self.rng = random.Random(seed)
        self.cap = cap
        self.count = 0
        shared = fit.prefix_hit_share * fit.prompt_len.observed_mean
        self.shared = list(range(1, int(shared // block_size) * block_size + 1))
        self.pool_tokens = pool_tokens
        self.block_size = block_size

    def next(self, arrival: float) -> tuple[Request, float]:
        prompt_len = self.fit.prompt_len.sample(self.rng)
        output_len = self.fit.output_len.sample(self.rng)
        if self.cap is not None:
            output_len = min(output_len, self.cap)
        # a request that could never fit the pool alone is one the engine refuses; the fit's tail can
        # draw one where the real workload had none, so it is cut to what the pool can hold
        room = (self.pool_tokens // self.block_size) * self.block_size
        prompt_len = min(prompt_len, room - 1)
        output_len = max(1, min(output_len, room + 1 - prompt_len))
        self.count += 1
        shared = self.shared[: max(0, prompt_len - 1)]
        base = self.count * _UNIQUE_BASE
        tokens = shared + list(range(base, base + prompt_len - len(shared)))
        request = Request(str(self.count), tokens, output_len, expected_output_len=output_len)
        return request, arrival


def _pool_slots(fit: FittedWorkload, candidate: Candidate) -> int:
    """Token slots of the candidate's pool, in whole blocks."""
    pool_tokens = fit.settings.pool_tokens
    if candidate.fp8:
        pool_tokens = int(pool_tokens * fp8_pool_factor(fit.settings.cache_dtype))
    block_size = candidate.block_size or fit.settings.block_size
    return pool_tokens // block_size * block_size


def simulate(
    fit: FittedWorkload, candidate: Candidate, seed: int = 0, horizon: Horizon | None = None
) -> Prediction:
    """One candidate's run over the fitted workload."""
    horizon = horizon or Horizon()
    settings = fit.settings
    block_size = candidate.block_size or settings.block_size
    cap = candidate.max_tokens_cap if candidate.max_tokens_cap is not None else settings.max_tokens_cap
    allocator = PagedAllocator(
        _pool_slots(fit, candidate) // block_size, block_size, enable_prefix_caching=fit.prefix_hit_share > 0
    )
    scheduler = Scheduler(
        allocator,
        SchedulerConfig(
            max_num_seqs=candidate.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            discard_output_on_preempt=False,
        ),
    )
    stream = _Requests(fit, seed, cap, allocator.num_slots, block_size)
    arrivals = random.Random(seed + 0x5EED)
    step_time = fit.step_time
    rate = fit.arrival.rate_per_s or 0.0
    arrived_at: dict[str, float] = {}
    clock = 0.0
    next_arrival = math.inf
    if fit.arrival.clients is not None:
        for _ in range(fit.arrival.clients):
            request, _ = stream.next(0.0)
            scheduler.add_request(request)
            arrived_at[request.request_id] = 0.0
    elif rate > 0:
        next_arrival = arrivals.expovariate(rate)
    warmup, measured = horizon.steps(fit.output_len.observed_mean, candidate.max_num_seqs)
    waits: list[float] = []
    tokens = finished = running_sum = sequence_steps = prefill_tokens = 0
    peak_slots = 0
    preempted_before = 0
    preemption_steps: list[int] = []
    started = 0.0
    overloaded = seqs_bound = memory_bound = False
    num_slots = allocator.num_slots
    waiting = scheduler.waiting
    for step in range(warmup + measured):
        if step == warmup:
            preempted_before, started = scheduler.num_preemptions, clock
        while next_arrival <= clock or (not scheduler.has_work and next_arrival < math.inf):
            clock = max(clock, next_arrival)
            if len(waiting) < horizon.max_waiting:
                request, _ = stream.next(next_arrival)
                scheduler.add_request(request)
                arrived_at[request.request_id] = next_arrival
            else:
                overloaded = True
            next_arrival += arrivals.expovariate(rate)
        out = scheduler.schedule()
        if out.preempted and step >= warmup:
            preemption_steps.extend([step - warmup] * len(out.preempted))
        if out.blocked is not None:
            if out.blocked.reason == "max_num_seqs":
                seqs_bound = True
            elif out.blocked.reason == "memory":
                memory_bound = True
        if out.preempted:
            memory_bound = True
        measuring = step >= warmup
        held = allocator.slots_held
        if held > peak_slots:
            peak_slots = held
        if measuring:
            for request in out.admitted:
                if request.num_preemptions == 0:
                    waits.append(clock - arrived_at[request.request_id])
            running_sum += len(scheduler.running)
        prefill = 0
        for n in out.num_tokens:
            if n > 1:
                prefill += n
        clock += step_time.seconds(len(out.requests), prefill)
        if measuring:
            sequence_steps += len(out.requests)
            prefill_tokens += prefill
        for request in out.requests:
            if request.num_computed_tokens != request.num_tokens:
                continue
            if measuring:
                tokens += 1
            if scheduler.append_token(request, 0):
                del arrived_at[request.request_id]
                if measuring:
                    finished += 1
                if fit.arrival.clients is not None:
                    replacement, _ = stream.next(clock)
                    scheduler.add_request(replacement)
                    arrived_at[replacement.request_id] = clock
        scheduler.pop_finished()
    span = clock - started
    preemptions = scheduler.num_preemptions - preempted_before
    per_min = preemptions / span * 60 if span > 0 else 0.0
    return Prediction(
        candidate=candidate,
        preemptions=preemptions,
        preemptions_per_min=per_min,
        goodput=tokens / span if span > 0 else 0.0,
        p95_queue_wait_s=_quantile(waits, 0.95),
        running_mean=running_sum / measured,
        peak_kv_usage=peak_slots / num_slots,
        simulated_s=span,
        finished=finished,
        overloaded=overloaded,
        seqs_bound=seqs_bound,
        memory_bound=memory_bound,
        raw_preemptions_per_min=per_min,
        steps=measured,
        sequence_steps=sequence_steps,
        prefill_tokens=prefill_tokens,
        tokens=tokens,
        preemption_steps=tuple(preemption_steps),
    )


def pooled(runs: Sequence[Prediction]) -> Prediction:
    """Several seeds' runs of one candidate as one prediction: their measured spans one after another
    (rates over the total, the highest peak, the median p95 wait), so a verdict at the edge rests on more
    than one draw of the workload."""
    first = runs[0]
    seconds = sum(r.simulated_s for r in runs)
    tokens = sum(r.tokens for r in runs)
    preemptions = sum(r.preemptions for r in runs)
    steps: list[int] = []
    offset = 0
    for r in runs:
        steps += [offset + s for s in r.preemption_steps]
        offset += r.steps
    rate = preemptions / seconds * 60 if seconds > 0 else 0.0
    waits = sorted(r.p95_queue_wait_s for r in runs)
    return replace(
        first,
        preemptions=preemptions,
        preemptions_per_min=rate,
        raw_preemptions_per_min=rate,
        goodput=tokens / seconds if seconds > 0 else 0.0,
        p95_queue_wait_s=waits[len(waits) // 2],
        running_mean=sum(r.running_mean * r.steps for r in runs) / max(1, offset),
        peak_kv_usage=max(r.peak_kv_usage for r in runs),
        simulated_s=seconds,
        finished=sum(r.finished for r in runs),
        overloaded=any(r.overloaded for r in runs),
        seqs_bound=any(r.seqs_bound for r in runs),
        memory_bound=any(r.memory_bound for r in runs),
        steps=offset,
        sequence_steps=sum(r.sequence_steps for r in runs),
        prefill_tokens=sum(r.prefill_tokens for r in runs),
        tokens=tokens,
        preemption_steps=tuple(steps),
        seeds=sum(r.seeds for r in runs),
    )


def simulate_seeds(
    fit: FittedWorkload, candidate: Candidate, seed: int = 0, seeds: int = 1, horizon: Horizon | None = None
) -> Prediction:
    """`seeds` runs (seed, seed + 1, ...) pooled."""
    return pooled([simulate(fit, candidate, s, horizon) for s in range(seed, seed + seeds)])


def effective(fit: FittedWorkload, candidate: Candidate) -> Candidate:
    """The candidate as the workload sees it: a closed loop of N clients never runs more than N, so every
    max_num_seqs above N behaves as N (one run answers them all)."""
    clients = fit.arrival.clients
    if clients is not None and candidate.max_num_seqs > clients:
        return replace(candidate, max_num_seqs=clients)
    return candidate


def isotonic(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in weighted least squares (pool-adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for value, weight in zip(values, weights, strict=True):
        blocks.append([value, max(weight, 1e-12), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean2, weight2, length2 = blocks.pop()
            mean1, weight1, length1 = blocks[-1]
            total = weight1 + weight2
            blocks[-1] = [(mean1 * weight1 + mean2 * weight2) / total, total, length1 + length2]
    out: list[float] = []
    for mean, _, length in blocks:
        out += [mean] * int(length)
    return out


def _group(candidate: Candidate) -> tuple[bool, int | None, int | None]:
    return (candidate.fp8, candidate.block_size, candidate.max_tokens_cap)


Runs = dict[Candidate, Prediction]


def _run_all(
    fit: FittedWorkload,
    candidates: Iterable[Candidate],
    seed: int,
    horizon: Horizon | None,
    runs: Runs,
    seeds: int = 1,
) -> None:
    """Simulate every candidate not in `runs` yet, sharing runs that are provably the same run: a closed
    loop never holds more than its clients; a run whose admission max_num_seqs never held back is the run
    of every larger value; an FP8 run whose 16-bit twin never ran out of memory is that twin."""
    todo = sorted(
        {effective(fit, c) for c in candidates} - set(runs), key=lambda c: (_group(c), c.max_num_seqs)
    )
    for candidate in todo:
        below = [
            r
            for c, r in runs.items()
            if _group(c) == _group(candidate) and c.max_num_seqs < candidate.max_num_seqs
        ]
        unbound = [r for r in below if not r.seqs_bound]
        twin = runs.get(replace(candidate, fp8=False)) if candidate.fp8 else None
        if unbound:
            runs[candidate] = replace(unbound[0], candidate=candidate)
        elif twin is not None and not twin.memory_bound:
            share = _pool_slots(fit, twin.candidate) / _pool_slots(fit, candidate)
            runs[candidate] = replace(twin, candidate=candidate, peak_kv_usage=twin.peak_kv_usage * share)
        else:
            runs[candidate] = simulate_seeds(fit, candidate, seed, seeds, horizon)


def _smoothed(runs: Runs) -> Runs:
    """Within each group of candidates that differ only by max_num_seqs, preemption rates made
    non-decreasing in max_num_seqs (isotonic regression weighted by simulated time): more admitted
    sequences never preempt less in expectation, and one seeded run's noise can say otherwise near the
    edge. `raw_preemptions_per_min` keeps each run's own figure."""
    by_group: dict[tuple[bool, int | None, int | None], list[Candidate]] = {}
    for candidate in sorted(runs, key=lambda c: c.max_num_seqs):
        by_group.setdefault(_group(candidate), []).append(candidate)
    out: Runs = {}
    for members in by_group.values():
        rows = [runs[c] for c in members]
        smoothed = isotonic([r.raw_preemptions_per_min for r in rows], [r.simulated_s for r in rows])
        for c, r, value in zip(members, rows, smoothed, strict=True):
            out[c] = replace(r, preemptions_per_min=value)
    return out


def what_if(
    fit: FittedWorkload,
    candidates: Iterable[Candidate],
    seed: int = 0,
    horizon: Horizon | None = None,
    seeds: int = 1,
) -> tuple[Prediction, ...]:
    """Every candidate's prediction (`seeds` runs pooled), in the order given; runs shared where they are
    the same run, and preemption rates smoothed to be non-decreasing in max_num_seqs (`_run_all`,
    `_smoothed`)."""
    wanted = list(candidates)
    runs: Runs = {}
    _run_all(fit, wanted, seed, horizon, runs, seeds)
    smoothed = _smoothed(runs)
    return tuple(replace(smoothed[effective(fit, c)], candidate=c) for c in wanted)


def max_num_seqs_candidates(fit: FittedWorkload, round_to: int = 1, count: int = 10) -> list[int]:
    """max_num_seqs values worth simulating, multiples of `round_to`: from a quarter of the pool's
    mean-footprint capacity up to twice it or the current setting, whichever is higher, never above the
    clients of a closed loop; every multiple when there are at most `count`, else `count` spread evenly."""
    capacity = fit.settings.pool_tokens / max(1.0, fit.mean_footprint)
    top = max(2 * capacity, fit.settings.max_num_seqs)
    if fit.arrival.clients is not None:
        top = min(top, fit.arrival.clients)
    first = max(round_to, math.ceil(max(1.0, capacity / 4) / round_to) * round_to)
    last = max(first, math.floor(top / round_to) * round_to)
    multiples = list(range(first, last + 1, round_to))
    if len(multiples) <= count:
        return multiples
    picked = {multiples[round(i * (len(multiples) - 1) / (count - 1))] for i in range(count)}
    return sorted(picked)


def standard_candidates(
    fit: FittedWorkload, round_to: int = 1, count: int = 10, with_fp8: bool = True
) -> list[Candidate]:
    """Every max_num_seqs value of `max_num_seqs_candidates`, then the same values with FP8 KV (when the
    cache is not FP8 already, and `with_fp8`)."""
    values = max_num_seqs_candidates(fit, round_to, count)
    table = [Candidate(v) for v in values]
    if with_fp8 and fp8_pool_factor(fit.settings.cache_dtype) > 1:
        table += [Candidate(v, fp8=True) for v in values]
    return table


def _pool_edge(
    fit: FittedWorkload,
    runs: Runs,
    fp8: bool,
    risk_margin: float,
    round_to: int,
    seed: int,
    seeds: int,
    horizon: Horizon | None,
) -> None:
    """Re-run the values at the NoPreemption edge of one pool setting with `seeds` seeds pooled, walking
    down while the largest safe value turns out unsafe and up while the next one turns out safe: one
    seed's draw decides the edge wrongly about as often as right (BENCHMARKS.md, `kvtune bench whatif`)."""

    def settle(value: int) -> Prediction:
        candidate = effective(fit, Candidate(value, fp8=fp8))
        known = runs.get(candidate)
        if known is None:
            known = simulate(fit, candidate, seed, horizon)
        if known.seeds < seeds:
            more = [simulate(fit, candidate, s, horizon) for s in range(seed + known.seeds, seed + seeds)]
            known = pooled([known, *more])
        runs[candidate] = known
        return known

    rows = sorted((r for c, r in runs.items() if c.fp8 == fp8), key=lambda r: r.candidate.max_num_seqs)
    safe = [r.candidate.max_num_seqs for r in rows if r.safe(risk_margin)]
    value = max(safe) if safe else round_to
    while value > round_to and not settle(value).safe(risk_margin):
        value -= round_to
    top = max(r.candidate.max_num_seqs for r in rows)
    while (
        value + round_to <= top
        and settle(value).safe(risk_margin)
        and settle(value + round_to).safe(risk_margin)
    ):
        value += round_to


def decision_table(
    fit: FittedWorkload,
    round_to: int = 1,
    risk_margin: float = DEFAULT_RISK_MARGIN,
    count: int = 10,
    seed: int = 0,
    horizon: Horizon | None = None,
    edge_seeds: int = EDGE_SEEDS,
    with_fp8: bool = True,
) -> tuple[Prediction, ...]:
    """The table a decision reads: `standard_candidates` (FP8 rows only `with_fp8`: the tuner's own move
    needs the 16-bit rows alone, at half the time), then, in each pool setting, every multiple of
    `round_to` between the largest value safe at `risk_margin` (`Prediction.safe`) and the next value
    simulated above it, so the edge is known to one step; then the values at the 16-bit edge again with
    `edge_seeds` seeds pooled (`_pool_edge`). Sorted: 16-bit rows first, by max_num_seqs."""
    runs: Runs = {}
    first = standard_candidates(fit, round_to, count, with_fp8)
    _run_all(fit, first, seed, horizon, runs)
    fill: list[Candidate] = []
    groups = sorted({c.fp8 for c in first})
    for fp8 in groups:
        rows = sorted((r for c, r in runs.items() if c.fp8 == fp8), key=lambda r: r.candidate.max_num_seqs)
        safe = [r.candidate.max_num_seqs for r in rows if r.safe(risk_margin)]
        low = max(safe) if safe else 0
        above = [r.candidate.max_num_seqs for r in rows if r.candidate.max_num_seqs > low]
        if above:
            fill += [
                Candidate(v, fp8=fp8) for v in range(low + round_to, above[0], round_to) if v >= round_to
            ]
    _run_all(fit, fill, seed, horizon, runs)
    if edge_seeds > 1:  # the setting in force; FP8's edge is advice and keeps its one seed
        _pool_edge(fit, runs, False, risk_margin, round_to, seed, edge_seeds, horizon)
    smoothed = _smoothed(runs)
    return tuple(sorted(smoothed.values(), key=lambda r: (r.candidate.fp8, r.candidate.max_num_seqs)))


def predictions_for(table: Sequence[Prediction], **match: object) -> list[Prediction]:
    """The rows whose candidate has every given field value (e.g. fp8=False), in table order."""
    return [p for p in table if all(getattr(p.candidate, k) == v for k, v in match.items())]
