"""The engine loop: kvtune.core's scheduler driving a real model over the paged KV cache (the steps of one
request: ARCHITECTURE.md). The engine admits requests and runs each step; the scheduler learns of a step once,
in `update_from_output`; the output processor (`output.py`) turns tokens into text, stops and figures; the
ModelRunner owns the model, the cache and the kernels.

No request can fail another: the per-request parts of a step (sampling, stop checks, detokenizing) fail
that request alone, and a forward pass that raises is retried once per scheduled sequence, alone (re-running
a chunk rewrites the same cache slots with the same values); only a sequence whose solo pass raises too is
failed, its blocks freed and withdrawn from the prefix cache. A failed request ends with finish reason
"error" (vLLM's FinishReason.ERROR), apart from client aborts.

The engine holds the live max_tokens cap (`cap_setting`, which the admin API changes) but does not apply
it: the HTTP layer decides every request's max_tokens through `front.max_tokens_cap`, the one function the
proxy uses too. The prefix-defeat detector, when on, sees each prompt once, at its first admission, with
the prefix-cache hit the scheduler really found.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from kvtune.contract.admin import CapSetting
from kvtune.contract.knobs import CAP_MODES, CapMode
from kvtune.core import Request, Scheduler, SchedulerConfig, SchedulerStep, make_allocator, samples_now
from kvtune.core.accounting import tokens_held
from kvtune.core.forks import choice_id
from kvtune.core.prefix_defeats import PrefixDefeatDetector, cached_at_admission
from kvtune.engine.loop.output import (
    EngineCounters,
    FinishedStats,
    ModelOutput,
    OutputProcessor,
    RequestOutput,
)
from kvtune.engine.model.attention_metadata import ScheduledChunk
from kvtune.engine.model.engine_config import EngineConfig
from kvtune.engine.model.kv_cache import KVCache
from kvtune.engine.model.model_runner import ModelRunner
from kvtune.engine.model.sampling import SamplingParams
from kvtune.front.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    """A paged-attention inference engine on one device: requests in, a step at a time, on kvtune.core's
    scheduler; its OutputProcessor says what each step gave, its ModelRunner does the computing."""

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
        eos = self.tokenizer.eos_token_ids | frozenset(self.model_config.eos_token_ids)
        self.output = OutputProcessor(self.scheduler, self.tokenizer.decode, eos)

    @property
    def cache(self) -> KVCache:
        """The runner's KV cache: its geometry is what the metrics and the boot log report."""
        return self.runner.cache

    @property
    def counters(self) -> EngineCounters:
        return self.output.counters

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
        tracks = self.output.tracks
        choice_ids = [choice_id(request_id, i) for i in range(params.n)]
        if any(t.client_id == request_id for t in tracks.values()) or any(
            rid in tracks for rid in choice_ids
        ):
            raise ValueError(f"request id {request_id!r} is already running")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        expected = params.max_tokens if params.ignore_eos else None
        choices = [
            Request(
                rid,
                list(prompt_token_ids),
                params.max_tokens,
                expected_output_len=expected,
                cache_salt=cache_salt,
            )
            for rid in choice_ids
        ]
        self.scheduler.add_request(
            choices[0], choices[1:]
        )  # refuses a request the whole pool could never hold
        key = self.served_model_name if prefix_key is None else prefix_key
        for index, rid in enumerate(choice_ids):
            self.output.add(rid, request_id, index, params, arrival, key)

    def abort_request(self, request_id: str) -> None:
        """Drop a request and every choice of it, freeing their blocks (a client that went away)."""
        self.output.abort(request_id)

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
        """One step, as vLLM's `EngineCore.step`: schedule, run the model, update the scheduler once, then
        turn the sampled tokens into outputs (text, stop strings, figures) in the output processor."""
        out = self.scheduler.schedule()
        now = time.monotonic()
        self._scheduled(out, now)
        model = self._execute(out, now)
        sampled = self.output.sampled(model)
        self.scheduler.update_from_output(out, sampled, model.faulted)
        return self.output.process(model, sampled)

    def _scheduled(self, out: SchedulerStep, now: float) -> None:
        """What the step's admissions change before the model runs: queue times, counters, the detector, and
        the copy-on-write copies the allocator asked for."""
        self.output.scheduled(out, now)
        if self.prefix_detector is not None:
            self._observe_prompts(out)
        if out.copies:
            self.runner.copy_blocks(out.copies)

    def _observe_prompts(self, out: SchedulerStep) -> None:
        """Show the detector each prompt once, at its first admission, with the prefix-cache hit it got: a
        recompute after preemption hits its own blocks, which says nothing about the prompt's shape."""
        detector, tracks = self.prefix_detector, self.output.tracks
        assert detector is not None
        firsts = [r for r in out.admitted if r.num_preemptions == 0 and tracks[r.request_id].index == 0]
        if not firsts:
            return
        cached: list[int | None] = [None] * len(firsts)  # no prefix cache: a hit of 0 says nothing
        if self._caches_prefixes:
            cached = [*cached_at_admission(firsts, out.requests, out.num_tokens, self.cache.block_size)]
        for req, hit in zip(firsts, cached, strict=True):
            key = tracks[req.request_id].prefix_key
            detector.observe(key, req.prompt_token_ids, cache_salt=req.cache_salt, cached_tokens=hit)

    def _execute(self, out: SchedulerStep, now: float) -> ModelOutput:
        """Compute the step's batch (decodes first) and sample every row that samples now, with the n > 1
        choices the scheduler forks after this step sampling their parent's row. A chunk whose forward pass
        fails fails its client request, whose other choices then sample nothing."""
        if not out.requests:
            return ModelOutput(now)
        order = out.batch_order()
        reqs = [out.requests[i] for i in order]
        counts = [out.num_tokens[i] for i in order]
        logits, faults = self.runner.forward(self._chunks(reqs, counts))
        tracks = self.output.tracks
        for i, err in faults.items():
            logger.error("the forward pass of %s failed", reqs[i].request_id, exc_info=err)
        failed = {tracks[reqs[i].request_id].client_id: err for i, err in faults.items()}
        faulted = [(reqs[i], counts[i]) for i in faults]
        rows = [i for i, req in enumerate(reqs) if i not in faults and samples_now(req)]
        if failed:
            rows = [i for i in rows if tracks[reqs[i].request_id].client_id not in failed]
        sampling = [reqs[i] for i in rows]
        forks = self.scheduler.forks(out, faulted)
        if forks:
            row_of = {reqs[i].request_id: i for i in rows}
            rows += [row_of[parent.request_id] for _, parent in forks]
            sampling += [child for child, _ in forks]
        states = [tracks[r.request_id] for r in sampling]
        tokens, logprobs = self.runner.sample(
            logits, rows, [t.params for t in states], [t.generator for t in states]
        )
        return ModelOutput(now, sampling, tokens, logprobs, faulted, failed)

    def _chunks(self, reqs: list[Request], counts: list[int]) -> list[ScheduledChunk]:
        """What the runner computes for each scheduled request: its new tokens, after its cached ones."""
        chunks = []
        for req, n in zip(reqs, counts, strict=True):
            start = req.num_computed_tokens - n
            tokens = req.all_token_ids()[start : start + n] if n > 1 else [req.token_at(start)]
            chunks.append(ScheduledChunk(tokens, start, self.allocator.block_table(req)))
        return chunks

    def fail_in_flight(self, error: Exception) -> list[RequestOutput]:
        """A step raised outside the per-request guards: fail the requests it was running, not the queue."""
        return self.output.fail_in_flight(error)

    # --- figures for metrics and logs ----------------------------------------------------------------
    def pop_finished_stats(self) -> tuple[list[FinishedStats], list[float]]:
        """Finished-request figures and inter-token latencies since the last call."""
        return self.output.pop_stats()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self.scheduler.num_waiting_choices

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
