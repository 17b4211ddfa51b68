"""Run a workload through `kvtune.core` with a counting stub for the model and measure a window.

A step gives one token to every running sequence whose prompt is computed (a newly admitted request
computes its prompt and samples its first token in the same step, as a real engine does). The queue is
kept saturated, the first `warmup` steps fill the pool and are not measured.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from kvtune.core import Sampled, Scheduler, SchedulerConfig, make_allocator, samples_now
from kvtune.core.accounting import BLOCK_TABLE_ENTRY_BYTES, memory_map, snapshot
from kvtune.core.geometry import MIB, QWEN3_8B
from kvtune.sim.workload import Workload


@dataclass(frozen=True)
class SimConfig:
    workload: Workload
    policy: str = "paged"
    pool_tokens: int = 405_239
    block_size: int = 16
    round_pow2: bool = True
    steps: int = 3000
    warmup: int = 1000
    seed: int = 0
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    queue_depth: int = 64
    enable_prefix_caching: bool | None = None  # None: on exactly when the workload shares a prefix
    bytes_per_token: int = QWEN3_8B.bytes_per_token
    map_every: int = 0  # >0: keep a memory map every this many steps (for plots)

    @property
    def num_blocks(self) -> int:
        return self.pool_tokens // self.block_size


@dataclass
class FragmentationEvent:
    """The first time the head of the queue found enough free slots but no run large enough."""

    step: int
    request: int
    slots_needed: int
    slots_free: int
    free_runs: int
    largest_run: int


@dataclass
class SimResult:
    policy: str
    steps: int
    window_steps: int
    resident_sequences: float
    tokens_per_step: float
    effective_utilization: float
    reserved_fraction: float
    internal_fraction: float
    external_fraction: float
    held_and_empty_mib: float
    held_and_empty_slots_per_sequence: float
    block_table_kib: float
    preemptions: int
    discarded_tokens: int
    delivered_tokens: int
    shared_tokens_per_request: float
    head_blocked_steps: dict[str, int]
    first_fragmentation: FragmentationEvent | None
    steps_per_second: float
    memory_maps: list[list[int]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("memory_maps")
        return d


def simulate(cfg: SimConfig) -> SimResult:
    """One simulated run; every figure is measured over the last `steps - warmup` steps."""
    if cfg.warmup >= cfg.steps:
        raise ValueError(f"warm-up ({cfg.warmup}) must be shorter than the run ({cfg.steps} steps)")
    caching = cfg.enable_prefix_caching
    if caching is None:
        caching = cfg.workload.shared_prefix > 0
    alloc = make_allocator(
        cfg.policy, cfg.num_blocks, cfg.block_size, enable_prefix_caching=caching, round_pow2=cfg.round_pow2
    )
    sched = Scheduler(
        alloc,
        SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens),
    )
    stream = cfg.workload.requests(cfg.seed)
    window = cfg.steps - cfg.warmup
    blocked_steps: dict[str, int] = {}
    first_frag: FragmentationEvent | None = None
    sums = dict.fromkeys(
        ("resident", "tokens", "held", "reserved", "internal", "external", "table", "produced"), 0
    )
    preempt0 = discard0 = requests0 = hits0 = 0
    maps: list[list[int]] = []
    waiting = sched.waiting
    started = time.perf_counter()
    for step in range(cfg.steps):
        while len(waiting) < cfg.queue_depth:
            sched.add_request(stream.next())
        if step == cfg.warmup:
            requests0, hits0 = sched.prefix_cache.requests, sched.prefix_cache.hits
        out = sched.schedule()
        sampled = [Sampled(req, 0) for req in out.requests if samples_now(req)]
        produced = len(sampled)
        sched.update_from_output(out, sampled)
        blocked = out.blocked
        if blocked is not None:
            blocked_steps[blocked.reason] = blocked_steps.get(blocked.reason, 0) + 1
            if blocked.reason == "external_fragmentation" and first_frag is None:
                first_frag = FragmentationEvent(
                    step, int(waiting[0].request_id), blocked.slots_needed, blocked.slots_free,
                    blocked.free_runs, blocked.largest_run,
                )  # fmt: skip
        if cfg.map_every and step % cfg.map_every == 0:
            maps.append(memory_map(sched))
        if step == cfg.warmup:
            preempt0, discard0 = sched.num_preemptions, sched.discarded_tokens
        if step >= cfg.warmup:
            snap = snapshot(
                sched, externally_blocked=blocked is not None and blocked.reason == "external_fragmentation"
            )
            sums["resident"] += snap.resident_sequences
            sums["tokens"] += snap.tokens_held
            sums["held"] += snap.slots_held
            sums["reserved"] += snap.reserved_slots
            sums["internal"] += snap.internal_slots
            sums["external"] += snap.external_slots
            sums["table"] += snap.block_table_entries
            sums["produced"] += produced
        sched.pop_finished()
    elapsed = time.perf_counter() - started
    held = max(1, sums["held"])
    shared_n = sched.prefix_cache.requests - requests0
    shared_sum = sched.prefix_cache.hits - hits0
    empty_slots = (sums["held"] - sums["tokens"]) / window
    return SimResult(
        policy=cfg.policy,
        steps=cfg.steps,
        window_steps=window,
        resident_sequences=sums["resident"] / window,
        tokens_per_step=sums["produced"] / window,
        effective_utilization=sums["tokens"] / held,
        reserved_fraction=sums["reserved"] / held,
        internal_fraction=sums["internal"] / held,
        external_fraction=sums["external"] / (cfg.num_blocks * cfg.block_size * window),
        held_and_empty_mib=empty_slots * cfg.bytes_per_token / MIB,
        held_and_empty_slots_per_sequence=empty_slots / max(1e-9, sums["resident"] / window),
        block_table_kib=sums["table"] * BLOCK_TABLE_ENTRY_BYTES / window / 1024,
        preemptions=sched.num_preemptions - preempt0,
        discarded_tokens=sched.discarded_tokens - discard0,
        delivered_tokens=sums["produced"],
        shared_tokens_per_request=shared_sum / shared_n if shared_n else 0.0,
        head_blocked_steps=blocked_steps,
        first_fragmentation=first_frag,
        steps_per_second=cfg.steps / elapsed if elapsed > 0 else float("inf"),
        memory_maps=maps,
    )
