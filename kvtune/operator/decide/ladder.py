"""The remedy ladder, in the seed's order, as pure functions of a diagnosis: each says whether its remedy
applies now, the current and recommended values, and the evidence.

1. cap max_tokens server-side, 2. lower max_num_seqs, 3. flag prefix-hash defeats, 4. recommend FP8 KV.
The tuner walks them one at a time; `kvtune doctor` prints them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

from kvtune.contract.knobs import KNOB_KV_CACHE_DTYPE, KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.continuity import ALTERNATING_HINT
from kvtune.operator.decide.diagnosis import Diagnosis
from kvtune.operator.decide.policy import TuningPolicy
from kvtune.operator.decide.prefix_fixes import fix_text
from kvtune.operator.decide.sample import EngineView

FEEDBACK_STEP = 0.2  # each feedback step lowers max_num_seqs by this fraction (at least one)
CAP_TOLERANCE = 1.1  # an existing cap within 10% of the recommendation is left alone


class Remedy(Enum):
    CAP_MAX_TOKENS = "cap_max_tokens"
    LOWER_MAX_NUM_SEQS = "lower_max_num_seqs"
    FLAG_PREFIX_DEFEAT = "flag_prefix_defeat"
    RECOMMEND_FP8_KV = "recommend_fp8_kv"
    # not a rung: the what-if model's one move of max_num_seqs, made before the ladder (kvtune.core.predict)
    PREDICT_MAX_NUM_SEQS = "predict_max_num_seqs"


LADDER = (
    Remedy.CAP_MAX_TOKENS,
    Remedy.LOWER_MAX_NUM_SEQS,
    Remedy.FLAG_PREFIX_DEFEAT,
    Remedy.RECOMMEND_FP8_KV,
)
KNOBS = {
    Remedy.CAP_MAX_TOKENS: KNOB_MAX_TOKENS_CAP,
    Remedy.LOWER_MAX_NUM_SEQS: KNOB_MAX_NUM_SEQS,
    Remedy.FLAG_PREFIX_DEFEAT: None,  # a flag, never an action
    Remedy.RECOMMEND_FP8_KV: KNOB_KV_CACHE_DTYPE,
    Remedy.PREDICT_MAX_NUM_SEQS: KNOB_MAX_NUM_SEQS,
}


@dataclass(frozen=True)
class Advice:
    remedy: Remedy
    applicable: bool
    current: int | str | None
    recommended: int | str | None
    evidence: str

    @property
    def knob(self) -> str | None:
        return KNOBS[self.remedy]

    def as_json(self) -> dict[str, object]:
        return {
            "remedy": self.remedy.value,
            "applicable": self.applicable,
            "current": self.current,
            "recommended": self.recommended,
            "evidence": self.evidence,
        }


def recommended_cap(d: Diagnosis, policy: TuningPolicy) -> int | None:
    """Generation p99 x margin, rounded up to a multiple of 10, never below the policy's floor."""
    if d.generation_len is None:
        return None
    cap = math.ceil(d.generation_len.p99 * policy.cap_margin / 10) * 10
    return max(policy.cap_floor, cap)


def cap_max_tokens(d: Diagnosis, engine: EngineView, policy: TuningPolicy) -> Advice:
    current = engine.max_tokens_cap
    cap = recommended_cap(d, policy)

    def advice(applicable: bool, evidence: str) -> Advice:
        return Advice(Remedy.CAP_MAX_TOKENS, applicable, current, cap, evidence)

    if cap is None:
        return advice(False, "no finished requests yet: no generation-length distribution to size a cap from")
    gen = d.generation_len
    assert gen is not None
    basis = (
        f"generation length p50 {gen.p50:,.0f} / p99 {gen.p99:,.0f} tokens ({gen.count:.0f} requests, "
        f"{gen.since}); cap = p99 x {policy.cap_margin:g}, floor {policy.cap_floor:,}"
    )
    if d.capped_requests:
        modes = ", ".join(f"{mode or 'unlabelled'} {count:,.0f}" for mode, count in d.capped_requests)
        basis += f"; requests the cap changed in the window: {modes}"
    if not d.preempting:
        return advice(False, f"no preemption to fix; {basis}")
    if engine.max_model_len is not None and cap >= engine.max_model_len:
        return advice(
            False, f"a cap of {cap:,} would not bind below max_model_len {engine.max_model_len:,}; {basis}"
        )
    if current is not None and current <= cap * CAP_TOLERANCE:
        return advice(False, f"already capped at {current:,}; {basis}")
    declared = d.declared_max_tokens
    if declared is not None and declared.p99 <= cap:
        return advice(
            False,
            f"clients already ask for at most ~{declared.p99:,.0f} tokens (p99): a cap would not bind; {basis}",
        )
    return advice(True, f"stops a runaway generation holding blocks; {basis}")


def lower_max_num_seqs(d: Diagnosis, engine: EngineView, policy: TuningPolicy, feedback: bool) -> Advice:
    """First step sized from the pool and the p95 footprint; later steps (feedback) shave 20% off the
    residency actually reached, until preemption stops.

    The first step is the most residents whose total footprint fits the pool at its 95th percentile
    (diagnosis.pooled_p95_concurrency), not pool / p95: that divides as if every resident held a p95-sized
    request at its last token at once, which on vLLM's CPU build left the pool 70% empty and cost 22% of the
    throughput (BENCHMARKS.md, doctor-vllm). The total's p95 grows as N x mean + sqrt(N) x (p95 - mean), so
    one resident is sized exactly as pool / p95 and many approach pool / mean. Without the histograms'
    exact sums (no mean), pool / p95. Feedback covers the case where it is not enough."""
    current = engine.max_num_seqs
    sized = d.real_concurrency_ceiling
    running = "n/a" if d.running_max is None else f"{d.running_max:.0f}"
    figures = f"preemption rate {d.preemption_rate or 0:.2f}/s, running max {running}"
    if sized is not None and d.footprint_p95 is not None:
        figures += f"; KV pool {engine.pool_tokens:,} tokens / p95 footprint {d.footprint_p95:,.0f} = {sized}"
    pooled = d.pooled_p95_concurrency
    if pooled is not None and d.footprint_mean is not None and d.footprint_p95 is not None:
        figures += (
            f"; p95 of {pooled} residents' total footprint ~ {pooled} x {d.footprint_mean:,.0f} (mean) + "
            f"sqrt({pooled}) x {max(d.footprint_p95 - d.footprint_mean, 0):,.0f} (p95 - mean) fits the pool"
        )
        sized = pooled
    if not d.preempting:
        return Advice(Remedy.LOWER_MAX_NUM_SEQS, False, current, None, f"no preemption; {figures}")
    if current is None:
        return Advice(
            Remedy.LOWER_MAX_NUM_SEQS, sized is not None, None, sized and policy.clamp(sized),
            f"current max_num_seqs unknown; {figures}",
        )  # fmt: skip
    resident = min(current, math.ceil(d.running_max)) if d.running_max else current
    if feedback or sized is None or sized >= resident:
        target = resident - max(1, math.floor(resident * FEEDBACK_STEP))
        how = f"feedback: {resident} residents still preempt, step down {FEEDBACK_STEP:.0%}"
    else:
        target = sized
        how = (
            "sized from the p95 of the residents' total footprint"
            if sized == pooled
            else "sized from the real concurrency ceiling"
        )
    target = max(policy.clamp(target), current - policy.max_step)
    if target >= current:
        return Advice(
            Remedy.LOWER_MAX_NUM_SEQS, False, current, current,
            f"at the policy's floor ({policy.min_max_num_seqs}); {figures}",
        )  # fmt: skip
    return Advice(Remedy.LOWER_MAX_NUM_SEQS, True, current, target, f"{how}; {figures}")


def raise_max_num_seqs(d: Diagnosis, engine: EngineView, policy: TuningPolicy, unsafe: int | None) -> Advice:
    """The way back up, with hysteresis: only with no preemption, requests waiting, max_num_seqs the
    binding limit, and projected KV usage under the policy's target; never to a value that preempted.

    Each added seat must also fit one whole request at the p95 footprint in the headroom under the target:
    the residents sampled were part-way through their generations, so scaling their usage up (the projection)
    under-counts what a newly admitted request will grow to. Without this, a pool with a seat's worth of
    headroom on average but not at its peaks was probed one seat up, preempted, and rolled back: a wasted
    raise-and-rollback cycle (the tuner benchmark, BENCHMARKS.md)."""
    current = engine.max_num_seqs

    def no(evidence: str) -> Advice:
        return Advice(Remedy.LOWER_MAX_NUM_SEQS, False, current, current, evidence)

    if current is None or d.preempting or d.preemption_rate is None:
        return no("not a candidate for raising")
    kv_max = d.kv_usage_max
    if not d.waiting_max or kv_max is None or (d.running_max or 0) < current:
        return no("nobody waits on max_num_seqs")
    fit = math.floor(current * policy.raise_kv_target / max(kv_max, 0.01))
    target = min(fit, current + policy.max_step, policy.max_max_num_seqs)
    if unsafe is not None:
        target = min(target, unsafe - 1)
    # sampled KV usage misses the peaks between samples: never probe above the first step's own sizing,
    # which grows again when requests get shorter
    sized = d.pooled_p95_concurrency
    if sized is not None:
        target = min(target, sized)
    seats = None
    if engine.pool_tokens and d.footprint_p95:
        seats = math.floor((policy.raise_kv_target - kv_max) * engine.pool_tokens / d.footprint_p95)
        target = min(target, current + seats)
    if target <= current:
        return no(
            f"no headroom: KV usage max {kv_max:.0%} (target {policy.raise_kv_target:.0%}), unsafe {unsafe}"
            + (f", pooled-p95 sizing {sized}" if sized is not None else "")
            + (f", headroom holds {max(seats, 0)} p95-footprint requests" if seats is not None else "")
        )
    return Advice(
        Remedy.LOWER_MAX_NUM_SEQS, True, current, target,
        f"raise: KV usage max {kv_max:.0%} at {current} residents, {d.waiting_mean or 0:.1f} waiting; "
        f"projected {kv_max * target / current:.0%} at {target}",
    )  # fmt: skip


def probe_max_num_seqs(d: Diagnosis, engine: EngineView, policy: TuningPolicy, unsafe: int | None) -> Advice:
    """The one probe up after a first cut that held: to the pool / mean footprint, every resident at its
    mean full length.

    The first cut (pooled p95) is on the safe side, since residents are part-way through their generations
    and hold less than their full footprint. Creeping back up one seat at a time on sampled KV headroom took
    a noisy while to happen or not, where pool / mean footprint landed on the sweep-best value at once
    (BENCHMARKS.md, the tuner sections). A probe that preempts is rolled back and its value is not tried
    again for `unsafe_memory_s`."""
    current = engine.max_num_seqs

    def no(evidence: str) -> Advice:
        return Advice(Remedy.LOWER_MAX_NUM_SEQS, False, current, current, evidence)

    if current is None or d.preempting or d.preemption_rate is None:
        return no("not a candidate for a probe")
    if not d.waiting_max or (d.running_max or 0) < current:
        return no("nobody waits on max_num_seqs")
    sized = d.mean_footprint_concurrency
    if sized is None or d.footprint_mean is None:
        return no("no mean footprint to size a probe from")
    target = min(sized, current + policy.max_step, policy.max_max_num_seqs)
    if unsafe is not None:
        target = min(target, unsafe - 1)
    if target <= current:
        return no(f"pool / mean footprint {sized} is not above {current} (unsafe {unsafe})")
    return Advice(
        Remedy.LOWER_MAX_NUM_SEQS, True, current, target,
        f"probe: the first cut held without preemption; KV pool {engine.pool_tokens:,} tokens / mean "
        f"footprint {d.footprint_mean:,.0f} = {sized}; {d.waiting_mean or 0:.1f} waiting",
    )  # fmt: skip


def defeat_lines(d: Diagnosis, engine: EngineView) -> list[str]:
    """One line per defeat reason seen in the window, most tokens lost first: prompts defeated and their
    share of all defeats, tokens lost (and their share of the prompt tokens), and the fix."""
    counts, tokens = dict(d.prefix_defeats), dict(d.prefix_defeat_tokens)
    total = sum(counts.values())
    order = sorted(set(counts) | set(tokens), key=lambda r: (-tokens.get(r, 0.0), -counts.get(r, 0.0), r))
    lines = []
    for reason in order:
        count, lost = counts.get(reason, 0.0), tokens.get(reason)
        share = f" ({count / total:.0%} of defeats)" if total else ""
        lost_text = "tokens lost unknown"
        if lost is not None:
            of_prompts = f" ({lost / d.prompt_tokens:.0%} of prompt tokens)" if d.prompt_tokens else ""
            lost_text = f"{lost:,.0f} tokens lost{of_prompts}"
        shared = lost / count if lost and count else None
        fix = fix_text(reason, shared=shared, block=engine.block_size)
        lines.append(f"{reason}: {count:,.0f} prompts{share}, {lost_text}: {fix}")
    return lines


def flag_prefix_defeat(d: Diagnosis, engine: EngineView, policy: TuningPolicy) -> Advice:
    """Rung 3, a flag, never an action: only the client can change its prompts. The prefix-defeat detector
    (in kvtune serve, or a kvtune proxy in front of vLLM / SGLang) says why prompts missed the cache:
    `kvtune:prefix_defeats_total{reason}` and `kvtune:prefix_defeat_tokens_total{reason}` moving in the window
    flag at once, naming each reason, its share, the tokens lost and the fix. Without those series (a bare
    vLLM or SGLang) the rung fires only when the policy declares a shared-prefix length and the prefix-cache
    hit rate stays below the policy's floor."""
    rate = d.prefix_hit_rate
    rate_text = "n/a" if rate is None else f"{rate:.0%} ({d.prefix_hit_rate_source})"
    if d.prefix_defeats or d.prefix_defeat_tokens:
        lines = defeat_lines(d, engine)
        reasons = ", ".join(line.split(":", 1)[0] for line in lines)
        return Advice(Remedy.FLAG_PREFIX_DEFEAT, True, rate_text, f"fix the prompt layout ({reasons})",
                      f"defeat report: {'; '.join(lines)}; hit rate {rate_text}")  # fmt: skip
    if not policy.shared_prefix_tokens:
        return Advice(Remedy.FLAG_PREFIX_DEFEAT, False, rate_text, None, "no shared prefix declared")
    if rate is None or rate >= policy.min_prefix_hit_rate:
        return Advice(Remedy.FLAG_PREFIX_DEFEAT, False, rate_text, None,
                      f"hit rate {rate_text} with a declared {policy.shared_prefix_tokens}-token shared prefix")  # fmt: skip
    block = engine.block_size
    if block and policy.shared_prefix_tokens < block:
        cause = (
            f"the {policy.shared_prefix_tokens}-token shared prefix is shorter than one block ({block}): "
            "blocks hash whole, so it shares nothing"
        )
    else:
        cause = (
            "something defeats the block hash: a per-request timestamp or user id ahead of the shared "
            "text, or the prefix is not byte-identical"
        )
    return Advice(Remedy.FLAG_PREFIX_DEFEAT, True, rate_text, "fix the prompt layout",
                  f"hit rate {rate_text} below {policy.min_prefix_hit_rate:.0%} although the policy declares a "
                  f"{policy.shared_prefix_tokens}-token shared prefix; {cause}")  # fmt: skip


def pool_binds(d: Diagnosis, engine: EngineView) -> bool:
    """After rung 2 has done its work: requests wait while every seat max_num_seqs allows is taken, and
    max_num_seqs is already what the pool holds at the residents' mean footprint. Nothing preempts and the
    KV gauge may sit well under full (residents are part-way through their generations), yet the pool,
    not the scheduler, is what keeps the waiting requests out: the seed's rungs 3 and 4 ("check the prefix
    cache hit rate before adding hardware", then bytes per token) are for exactly this."""
    current = engine.max_num_seqs
    if current is None or (d.waiting_mean or 0.0) < 1.0 or (d.running_max or 0.0) < current:
        return False
    sized = d.mean_footprint_concurrency
    return sized is not None and current >= sized


def recommend_fp8_kv(d: Diagnosis, engine: EngineView, policy: TuningPolicy) -> Advice:
    dtype = engine.cache_dtype
    if dtype is not None and dtype.startswith("fp8"):
        return Advice(Remedy.RECOMMEND_FP8_KV, False, dtype, None, "KV cache is already FP8")
    binds = pool_binds(d, engine)
    if not (d.preempting or d.saturated or binds):
        return Advice(Remedy.RECOMMEND_FP8_KV, False, dtype, None, "no persistent KV pressure")
    pool = engine.pool_tokens
    gain = f"KV pool {pool:,} -> ~{2 * pool:,} tokens" if pool else "about twice the tokens"
    if d.real_concurrency_ceiling is not None:
        gain += (
            f", real concurrency ceiling {d.real_concurrency_ceiling} -> ~{2 * d.real_concurrency_ceiling}"
        )
    applied = (
        "the policy allows applying it" if policy.allow_fp8 else "recommendation only (allow_fp8 is off)"
    )
    return Advice(
        Remedy.RECOMMEND_FP8_KV, True, dtype, "fp8",
        f"{_pressure(d, engine, binds)}; FP8 KV stores 2x the tokens in the same bytes: {gain}. "
        "Caveat: quantised K/V cost some accuracy; check your evals, prefer calibrated scales. " + applied,
    )  # fmt: skip


def _pressure(d: Diagnosis, engine: EngineView, binds: bool) -> str:
    if d.preempting or d.saturated or not binds:
        return (
            f"pressure persists (preemption rate {d.preemption_rate or 0:.2f}/s, KV usage max "
            f"{_ratio(d.kv_usage_max)})"
        )
    return (
        f"the pool binds: {d.waiting_mean or 0:.1f} requests wait while max_num_seqs {engine.max_num_seqs} is "
        f"what the pool holds at the mean footprint ({engine.pool_tokens or 0:,} / {d.footprint_mean or 0:,.0f} "
        "tokens)"
    )


def rungs(d: Diagnosis, engine: EngineView, policy: TuningPolicy) -> tuple[Advice, ...]:
    """Every rung's advice, in ladder order, for this diagnosis of this engine (a lowering sized without
    the tuner's memory of an unsafe value)."""
    return (
        cap_max_tokens(d, engine, policy),
        lower_max_num_seqs(d, engine, policy, feedback=False),
        flag_prefix_defeat(d, engine, policy),
        recommend_fp8_kv(d, engine, policy),
    )


def plan(d: Diagnosis, engine: EngineView, policy: TuningPolicy) -> list[Advice]:
    """Every rung, in ladder order, as `kvtune doctor` shows them; none applies to samples from an
    alternating source (their rates are flips between processes)."""
    every = list(rungs(d, engine, policy))
    alternating = next((f for f in d.findings if f.code == "AlternatingSource"), None)
    if alternating is None:
        return every
    why = f"not sized: {ALTERNATING_HINT} ({alternating.evidence})"
    return [replace(advice, applicable=False, recommended=advice.current, evidence=why) for advice in every]


def _ratio(value: float | None) -> str:
    """A usage ratio as a percentage; n/a where the gauge was not read (a diagnosis from counters since boot)."""
    return "n/a" if value is None else f"{value:.0%}"
