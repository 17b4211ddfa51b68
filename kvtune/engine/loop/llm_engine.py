"""The engine loop: kvtune.core's scheduler driving a real model over the paged KV cache (the steps of one
request: ARCHITECTURE.md). The engine keeps the requests, their outputs, stops and stats; the ModelRunner
owns the model, the cache and the kernels.

No request can fail another: the per-request parts of a step (sampling, stop checks, detokenizing) fail
that request alone, and a forward pass that raises is retried once per scheduled sequence, alone (re-running
a chunk rewrites the same cache slots with the same values); only a sequence whose solo pass raises too is
failed, its blocks freed and withdrawn from the prefix cache. A failed request ends with finish reason
"error" (vLLM's FinishReason.ERROR), apart from client aborts.

The engine holds the live max_tokens cap (`cap_setting`, which the admin API changes) but does not apply
it: the HTTP layer decides every request's max_tokens through `core.max_tokens_cap`, the one function the
proxy uses too. The prefix-defeat detector, when on, sees each prompt once, at its first admission, with
the prefix-cache hit the scheduler really found.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtune.contract.admin import CapSetting
from kvtune.contract.knobs import CAP_MODES, CapMode
from kvtune.core import Request, Sampled, Scheduler, SchedulerConfig, make_allocator, samples_now
from kvtune.core.accounting import tokens_held
from kvtune.core.forks import PendingChoices, choice_id
from kvtune.core.prefix_defeats import PrefixDefeatDetector
from kvtune.core.request import FinishReason, RequestStatus
from kvtune.engine.loop.stops import StopChecker
from kvtune.engine.model.attention_metadata import ScheduledChunk
from kvtune.engine.model.engine_config import EngineConfig
from kvtune.engine.model.kv_cache import KVCache
from kvtune.engine.model.logprobs import TokenLogprobs
from kvtune.engine.model.model_runner import ModelRunner
from kvtune.engine.model.sampling import SamplingParams
from kvtune.front.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# vLLM's FinishReason.ERROR: the engine failed the request (counted apart from "abort", a client leaving).
ERROR_FINISH_REASON = "error"
# Where in a step a request failed (the label of kvtune:request_failures_total): its forward pass, its
# sampling, its output handling (stop checks, detokenizing), or elsewhere in the step.
FAILURE_STAGES = ("forward", "sampling", "output", "step")


@dataclass
class RequestOutput:
    """What one request (one choice of it, for n > 1) gained in one step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: TokenLogprobs | None = None  # only for requests that asked, and not for a hidden end token
    error: Exception | None = None  # set when the request failed: finish_reason is then "error"


@dataclass
class FinishedStats:
    """Per-request figures the latency and size histograms observe once a request ends."""

    finish_reason: str
    queue_time: float
    time_to_first_token: float | None
    e2e_latency: float
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    num_preemptions: int = 0  # times this request was preempted (vllm:request_num_preemptions)


@dataclass
class EngineCounters:
    """Monotonic counters since boot, in vLLM's sense of each name."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # failed requests by the stage that raised


@dataclass
class SequenceState:
    """Engine-side state of one scheduled sequence."""

    client_id: str
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    stops: StopChecker
    arrival: float
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (a recompute's hit is not the client's)
    prefix_key: str = ""  # what the prefix-defeat detector groups this prompt under (model or tenant)


class LLMEngine:
    """A paged-attention inference engine on one device: the requests, their outputs, stops and stats, on
    kvtune.core's scheduler; its ModelRunner does the computing."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        folder = Path(config.model)
        self.runner = ModelRunner(config)
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self.tokenizer = load_tokenizer(folder)
        self.served_model_name = config.served_model_name or folder.name
        self.allocator = make_allocator(
            config.allocator,
            self.cache.num_blocks,
            self.cache.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            round_pow2=config.allocator == "contiguous",
        )
        self.scheduler = Scheduler(
            self.allocator,
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                discard_output_on_preempt=False,
            ),
        )
        self.cap_setting = CapSetting(config.max_tokens_cap, config.cap_mode)
        # Only the paged policy caches prefixes: elsewhere a hit of 0 says nothing about evictions.
        self._caches_prefixes = config.enable_prefix_caching and config.allocator == "paged"
        self.prefix_detector = (
            PrefixDefeatDetector(self.cache.block_size, keep_span_tokens=config.prefix_report_text)
            if config.prefix_detector
            else None
        )
        self.counters = EngineCounters()
        self._tracks: dict[str, SequenceState] = {}
        self._choices = PendingChoices()
        self._finished_stats: list[FinishedStats] = []
        self._itl: list[float] = []
        self._eos = self.tokenizer.eos_token_ids | frozenset(self.model_config.eos_token_ids)

    @property
    def cache(self) -> KVCache:
        """The runner's KV cache: its geometry is what the metrics and the boot log report."""
        return self.runner.cache

    # --- requests ------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        cache_salt: str | None = None,
        prefix_key: str | None = None,
    ) -> None:
        """Queue a request (n > 1: its choices share the prompt's blocks). ValueError for what cannot run.

        `cache_salt`: the request shares prefix-cache blocks only with requests of the same salt.
        `prefix_key`: what the prefix-defeat detector compares this prompt with (default: the model name).
        """
        if cache_salt is not None and not cache_salt:
            raise ValueError("cache_salt must be a non-empty string")
        params.validate(self.model_config.vocab_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be below the vocabulary size {vocab}")
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n_prompt} tokens; this model's maximum context length is {self.max_model_len}"
            )
        if n_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens {params.max_tokens} + {n_prompt} prompt tokens exceeds the maximum context "
                f"length {self.max_model_len}"
            )
        # Choice i > 0 runs as "<id>#<i>": no new id may collide with a live one either way round.
        choice_ids = [choice_id(request_id, i) for i in range(params.n)]
        if any(t.client_id == request_id for t in self._tracks.values()) or any(
            rid in self._tracks for rid in choice_ids
        ):
            raise ValueError(f"request id {request_id!r} is already running")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        key = self.served_model_name if prefix_key is None else prefix_key
        parent = self._make_request(request_id, 0, prompt_token_ids, params, arrival, cache_salt, key)
        try:
            self.scheduler.add_request(parent)  # refuses a request the whole pool could never hold
        except ValueError:
            del self._tracks[parent.request_id]
            raise
        children = [
            self._make_request(request_id, index, prompt_token_ids, params, arrival, cache_salt, key)
            for index in range(1, params.n)
        ]
        self._choices.hold(parent.request_id, children)

    def _make_request(
        self,
        client_id: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        arrival: float,
        cache_salt: str | None,
        prefix_key: str,
    ) -> Request:
        rid = choice_id(client_id, index)
        expected = params.max_tokens if params.ignore_eos else None
        req = Request(
            rid, list(prompt), params.max_tokens, expected_output_len=expected, cache_salt=cache_salt
        )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed + index)
        stops = StopChecker(params, self._eos, self.tokenizer.decode)
        self._tracks[rid] = SequenceState(
            client_id, index, params, generator, stops, arrival, prefix_key=prefix_key
        )
        return req

    def abort_request(self, request_id: str) -> None:
        """Drop a request and every choice of it, freeing their blocks (a client that went away)."""
        for rid, track in list(self._tracks.items()):
            if track.client_id != request_id:
                continue
            self._release_choices(rid)
            req = self.scheduler.abort(rid)
            if req is not None:
                self._record_finished(req, track)
            self._tracks.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    # --- live configuration (the operator's levers) ---------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.config.max_num_seqs

    @property
    def max_num_seqs_limit(self) -> int:
        """The most sequences the pool can hold at once: each running sequence needs at least one block."""
        return self.cache.num_blocks

    def check_max_num_seqs(self, value: int) -> None:
        """ValueError naming the bound unless 1 <= value <= the pool's blocks (the one check of this knob)."""
        if value <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {value}")
        if value > self.max_num_seqs_limit:
            raise ValueError(
                f"max_num_seqs must be at most {self.max_num_seqs_limit} (the KV pool's blocks: each running "
                f"sequence needs at least one), got {value}"
            )

    @property
    def max_tokens_cap(self) -> int | None:
        return self.cap_setting.cap

    @property
    def cap_mode(self) -> CapMode:
        return self.cap_setting.mode

    @staticmethod
    def check_cap_mode(mode: str) -> None:
        """ValueError naming the choices unless `mode` is one of CAP_MODES."""
        if mode not in CAP_MODES:
            raise ValueError(f"cap_mode must be one of {', '.join(CAP_MODES)}, got {mode!r}")

    def check_max_tokens_cap(self, value: int | None) -> None:
        """ValueError naming the bound unless the cap is None or 1 <= value <= max_model_len."""
        if value is None:
            return
        if value <= 0:
            raise ValueError(f"max_tokens_cap must be positive, got {value}")
        if value > self.max_model_len:
            raise ValueError(
                f"max_tokens_cap must be at most max_model_len {self.max_model_len}, got {value}"
            )

    def set_max_num_seqs(self, value: int) -> None:
        """Takes effect at the next admission; lowering it evicts nobody, admission simply waits."""
        self.check_max_num_seqs(value)
        self.scheduler.config.max_num_seqs = value

    def set_max_tokens_cap(self, value: int | None) -> None:
        """Cap max_tokens of requests that arrive from now on (None: no cap)."""
        self.check_max_tokens_cap(value)
        self.cap_setting = CapSetting(value, self.cap_setting.mode)

    def set_cap_mode(self, mode: CapMode) -> None:
        """`clamp` or `reject` requests over the cap that arrive from now on."""
        self.check_cap_mode(mode)
        self.cap_setting = CapSetting(self.cap_setting.cap, mode)

    # --- one step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        preempted_before = sched.num_preemptions
        out = sched.schedule()
        self.counters.num_preemptions += sched.num_preemptions - preempted_before
        now = time.monotonic()
        for req in out.admitted:
            track = self._tracks[req.request_id]
            if track.scheduled_at is None:
                track.scheduled_at = now
            if req.num_preemptions == 0:
                track.num_cached_tokens = req.num_cached_tokens
                self.counters.prompt_tokens += req.num_prompt_tokens if track.index == 0 else 0
        if self.prefix_detector is not None:
            self._observe_prompts(out.requests, out.num_tokens, out.admitted)
        self.counters.prefix_cache_queries = sched.prefix_cache.queries
        self.counters.prefix_cache_hits = sched.prefix_cache.hits
        if out.copies:
            self.runner.copy_blocks(out.copies)
        if not out.requests:
            return self._drain_finished([])
        order = sorted(range(len(out.requests)), key=lambda i: out.num_tokens[i] != 1)
        reqs = [out.requests[i] for i in order]
        counts = [out.num_tokens[i] for i in order]
        logits, faults = self.runner.forward(self._chunks(reqs, counts))
        outputs: list[RequestOutput] = []
        for i, err in faults.items():
            logger.error("the forward pass of %s failed", reqs[i].request_id, exc_info=err)
        failed_clients = {self._tracks[reqs[i].request_id].client_id: err for i, err in faults.items()}
        sched.withdraw_faulted((reqs[i], counts[i]) for i in faults)
        for client_id, err in failed_clients.items():
            outputs += self.fail_request(client_id, err, "forward")
        rows = [i for i, req in enumerate(reqs) if i not in faults and samples_now(req)]
        sampling = [reqs[i] for i in rows]
        rows += [rows[parent] for parent in self._choices.fork(sched, sampling)]
        tracks = [self._tracks[r.request_id] for r in sampling]
        tokens, logprobs = self.runner.sample(
            logits, rows, [t.params for t in tracks], [t.generator for t in tracks]
        )
        for req, track, token, token_logprobs in zip(sampling, tracks, tokens, logprobs, strict=True):
            if req.status is RequestStatus.FINISHED:
                continue  # another choice of the same client request failed earlier in this loop
            if isinstance(token, Exception):
                outputs += self.fail_request(track.client_id, token, "sampling")
                continue
            try:
                outputs.append(self._append(req, track, token, now, token_logprobs))
            except Exception as err:
                outputs += self.fail_request(track.client_id, err, "output")
        return self._drain_finished(outputs)

    def _observe_prompts(self, scheduled: list[Request], counts: list[int], admitted: list[Request]) -> None:
        """Show the detector each prompt once, at its first admission, with the prefix-cache hit it got.

        A recompute after preemption hits its own blocks, which says nothing about the prompt's shape, so it
        is never shown again. The cache publishes a block only once a step has scheduled it, so a prompt
        admitted beside another with the same prefix (earlier in this step, or one still in prefill) misses
        blocks that were never cached, not evicted: those count as hits here, so `evicted` means evicted.
        """
        detector = self.prefix_detector
        assert detector is not None
        firsts = [r for r in admitted if r.num_preemptions == 0 and self._tracks[r.request_id].index == 0]
        if not firsts:
            return
        in_flight: set[int] = set()
        if self._caches_prefixes:
            first_ids = {r.request_id for r in firsts}
            for req, n in zip(scheduled, counts, strict=True):
                if n > 1 and req.request_id not in first_ids:
                    in_flight.update(req.block_hashes)  # a prompt (re)computing: its tail is not cached yet
        block_size = self.cache.block_size
        for req in firsts:
            cached: int | None = None
            if self._caches_prefixes:
                hashes = req.block_hashes
                blocks = req.num_cached_tokens // block_size
                most = (req.num_prompt_tokens - 1) // block_size
                while blocks < min(most, len(hashes)) and hashes[blocks] in in_flight:
                    blocks += 1
                cached = max(req.num_cached_tokens, blocks * block_size)
                in_flight.update(hashes)
            track = self._tracks[req.request_id]
            detector.observe(
                track.prefix_key, req.prompt_token_ids, cache_salt=req.cache_salt, cached_tokens=cached
            )

    def _chunks(self, reqs: list[Request], counts: list[int]) -> list[ScheduledChunk]:
        """What the runner computes for each scheduled request: its new tokens, after its cached ones."""
        chunks = []
        for req, n in zip(reqs, counts, strict=True):
            start = req.num_computed_tokens - n
            tokens = req.all_token_ids()[start : start + n] if n > 1 else [req.token_at(start)]
            chunks.append(ScheduledChunk(tokens, start, self.allocator.block_table(req)))
        return chunks

    # --- failures ------------------------------------------------------------------------------------
    def fail_request(self, request_id: str, error: Exception, stage: str) -> list[RequestOutput]:
        """End every choice of client request `request_id` with finish reason "error", freeing its blocks.

        Returns the one output that carries `error` to the client (empty if the request is not live);
        `stage` (forward, sampling, output, step) is what the failure counters are labelled with.
        """
        tracks = [(rid, t) for rid, t in self._tracks.items() if t.client_id == request_id]
        if not tracks:
            return []
        first = self.scheduler.requests.get(tracks[0][0])
        for rid, track in tracks:
            self._release_choices(rid)
            req = self.scheduler.abort(rid)
            if req is not None:
                self._record_finished(req, track, ERROR_FINISH_REASON)
                self._tracks.pop(rid, None)
            elif all(r.request_id != rid for r in self.scheduler.finished):
                self._tracks.pop(rid, None)  # a choice still queued on its parent, never scheduled
            # else: a choice that finished normally earlier in this step; _drain_finished records it
        self.counters.failures[stage] = self.counters.failures.get(stage, 0) + 1
        head = tracks[0][1]
        return [
            RequestOutput(
                request_id=request_id,
                index=0,
                new_token_ids=[],
                new_text="",
                finished=True,
                finish_reason=ERROR_FINISH_REASON,
                num_prompt_tokens=first.num_prompt_tokens if first is not None else 0,
                num_output_tokens=len(first.output_token_ids) if first is not None else 0,
                num_cached_tokens=head.num_cached_tokens,
                error=error,
            )
        ]

    def fail_in_flight(self, error: Exception) -> list[RequestOutput]:
        """A step raised outside the per-request guards: fail the requests it was running, not the queue.

        With nothing running, the head of the queue (the request being admitted) is failed instead, so a
        fault that repeats every step still makes progress through the queue instead of spinning.
        """
        if isinstance(error, ValueError):
            # Only a per-request stage can blame the request's input (400); out here the engine is at fault.
            internal = RuntimeError(f"{type(error).__name__}: {error}")
            internal.__cause__ = error
            error = internal
        suspects = list(self.scheduler.running) or list(self.scheduler.waiting)[:1]
        client_ids = dict.fromkeys(
            self._tracks[r.request_id].client_id for r in suspects if r.request_id in self._tracks
        )
        outputs: list[RequestOutput] = []
        for client_id in client_ids:
            outputs += self.fail_request(client_id, error, "step")
        return self._drain_finished(outputs)

    def _release_choices(self, parent_id: str) -> None:
        """Forget the n > 1 choices still waiting on `parent_id`: they were never scheduled."""
        for child in self._choices.release(parent_id):
            self._tracks.pop(child.request_id, None)

    def _append(
        self,
        req: Request,
        track: SequenceState,
        token: int,
        now: float,
        logprobs: TokenLogprobs | None = None,
    ) -> RequestOutput:
        self.counters.generation_tokens += 1
        if track.first_token_at is None:
            track.first_token_at = now
        elif track.last_token_at is not None:
            self._itl.append(now - track.last_token_at)
        track.last_token_at = now
        stop_token = track.stops.is_stop(token)
        done = bool(self.scheduler.update_from_output([Sampled(req, token, stop_token)]))
        outcome = track.stops.text_after(self.scheduler, req, stop_token, done)
        done = outcome.finished
        return RequestOutput(
            request_id=track.client_id,
            index=track.index,
            new_token_ids=[token],
            new_text=outcome.new_text,
            finished=done,
            finish_reason=req.finish_reason.value if done and req.finish_reason else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=track.num_cached_tokens,
            logprobs=None if outcome.stop_token else logprobs,
        )

    def _drain_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for req in self.scheduler.pop_finished():
            track = self._tracks.pop(req.request_id, None)
            if track is not None:
                self._record_finished(req, track)
        return outputs

    def _record_finished(self, req: Request, track: SequenceState, reason: str | None = None) -> None:
        if reason is None:
            reason = req.finish_reason.value if req.finish_reason else FinishReason.ABORT.value
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        now = time.monotonic()
        started = track.scheduled_at if track.scheduled_at is not None else now
        self._finished_stats.append(
            FinishedStats(
                finish_reason=reason,
                queue_time=started - track.arrival,
                time_to_first_token=None
                if track.first_token_at is None
                else track.first_token_at - track.arrival,
                e2e_latency=now - track.arrival,
                prompt_tokens=req.num_prompt_tokens,
                generation_tokens=len(req.output_token_ids),
                max_tokens=track.params.max_tokens,
                num_preemptions=req.num_preemptions,
            )
        )

    # --- figures for metrics and logs ----------------------------------------------------------------
    def pop_finished_stats(self) -> tuple[list[FinishedStats], list[float]]:
        """Finished-request figures and inter-token latencies since the last call."""
        stats, self._finished_stats = self._finished_stats, []
        itl, self._itl = self._itl, []
        return stats, itl

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._choices)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's blocks held by running requests (vLLM's kv_cache_usage_perc, 0-1)."""
        return self.allocator.slots_held / self.allocator.num_slots

    @property
    def effective_utilization(self) -> float:
        held = self.allocator.slots_held
        return tokens_held(self.scheduler) / held if held else 1.0

    @property
    def held_empty_slots(self) -> int:
        return self.allocator.slots_held - tokens_held(self.scheduler)
