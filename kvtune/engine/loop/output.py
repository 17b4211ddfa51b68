"""From a step's sampled tokens to what each client receives (vLLM v1's OutputProcessor), out of `step`.

The scheduler learns of a step once, in `Scheduler.update_from_output`; everything only text shows happens
here, after it: incremental detokenizing, stop strings (which end their request through
`Scheduler.finish`), one `RequestOutput` per choice, and the figures the metrics observe (`FinishedStats`,
inter-token latencies, the counters). A request whose own stage raises is failed here, alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvtune.core import Request, RequestStatus, Sampled, Scheduler, SchedulerStep
from kvtune.core.request import FinishReason
from kvtune.engine.loop.detokenize import Decoder, StopChecker
from kvtune.engine.loop.errors import ERROR_FINISH_REASON
from kvtune.engine.model.logprobs import TokenLogprobs
from kvtune.engine.model.sampling import SamplingParams


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


@dataclass
class ModelOutput:
    """What the model gave one step (vLLM's ModelRunnerOutput): a token (or the row's error) per sampled
    row, in row order, and the chunks whose forward pass failed."""

    now: float
    rows: list[Request] = field(default_factory=list)
    tokens: list[int | Exception] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    faulted: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens in its chunk)
    failed: dict[str, Exception] = field(default_factory=dict)  # client id -> its forward pass's error


class OutputProcessor:
    """The per-sequence state of every live request and what its outputs say."""

    def __init__(self, scheduler: Scheduler, decode: Decoder, eos_token_ids: frozenset[int]) -> None:
        self.scheduler = scheduler
        self.tracks: dict[str, SequenceState] = {}
        self.counters = EngineCounters()
        self._decode = decode
        self._eos = eos_token_ids
        self._finished_stats: list[FinishedStats] = []
        self._itl: list[float] = []

    def add(
        self, rid: str, client_id: str, index: int, params: SamplingParams, arrival: float, prefix_key: str
    ) -> None:
        """Track choice `index` of `client_id`, scheduled as `rid` (a seeded choice i samples from seed + i)."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed + index)
        stops = StopChecker(params, self._eos, self._decode)
        self.tracks[rid] = SequenceState(
            client_id, index, params, generator, stops, arrival, prefix_key=prefix_key
        )

    # --- one step ------------------------------------------------------------------------------------
    def scheduled(self, step: SchedulerStep, now: float) -> None:
        """Note the step's admissions: queue time ends, and a first admission fixes the client's cache hit."""
        counters, sched = self.counters, self.scheduler
        for req in step.admitted:
            track = self.tracks[req.request_id]
            if track.scheduled_at is None:
                track.scheduled_at = now
            if req.num_preemptions == 0:
                track.num_cached_tokens = req.num_cached_tokens
                counters.prompt_tokens += req.num_prompt_tokens if track.index == 0 else 0
        counters.num_preemptions = sched.num_preemptions
        counters.prefix_cache_queries = sched.prefix_cache.queries
        counters.prefix_cache_hits = sched.prefix_cache.hits

    def sampled(self, model: ModelOutput) -> list[Sampled]:
        """The tokens the scheduler appends: a row that failed fails its client, whose later rows are dropped."""
        tracks = self.tracks
        failed: set[str] = set()
        sampled = []
        for req, token in zip(model.rows, model.tokens, strict=True):
            track = tracks[req.request_id]
            if track.client_id in failed:
                continue
            if isinstance(token, Exception):
                failed.add(track.client_id)
                continue
            sampled.append(Sampled(req, token, track.stops.is_stop(token)))
        return sampled

    def process(self, model: ModelOutput, sampled: list[Sampled]) -> list[RequestOutput]:
        """After `update_from_output` appended `sampled`: each row's output (its text, a stop string), the
        failures of the step, then the figures of every request the scheduler ended."""
        outputs: list[RequestOutput] = []
        for client_id, err in model.failed.items():
            outputs += self.fail(client_id, err, "forward")
        failed: set[str] = set()
        tracks, now = self.tracks, model.now
        appended = iter(sampled)
        one = next(appended, None)
        for req, token, logprobs in zip(model.rows, model.tokens, model.logprobs, strict=True):
            mine = one if one is not None and one.request is req else None
            if mine is not None:
                one = next(appended, None)
            track = tracks.get(req.request_id)
            if track is None or track.client_id in failed:
                continue  # another choice of the same client request failed earlier in this loop
            if mine is None:  # its row failed to sample
                failed.add(track.client_id)
                outputs += self.fail(track.client_id, _error(token), "sampling")
                continue
            try:
                outputs.append(self._output(mine, track, logprobs, now))
            except Exception as err:
                failed.add(track.client_id)
                outputs += self.fail(track.client_id, err, "output")
        return self.drain(outputs)

    def _output(
        self, one: Sampled, track: SequenceState, logprobs: TokenLogprobs | None, now: float
    ) -> RequestOutput:
        self.counters.generation_tokens += 1
        if track.first_token_at is None:
            track.first_token_at = now
        elif track.last_token_at is not None:
            self._itl.append(now - track.last_token_at)
        track.last_token_at = now
        req, stops = one.request, track.stops
        done = req.status is RequestStatus.FINISHED
        new_text = stops.text_after(req.output_token_ids, one.stop, done)
        if stops.stopped:
            self.scheduler.finish(req, FinishReason.STOP)
            done = True
        return RequestOutput(
            request_id=track.client_id,
            index=track.index,
            new_token_ids=[one.token],
            new_text=new_text,
            finished=done,
            finish_reason=req.finish_reason.value if done and req.finish_reason else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=track.num_cached_tokens,
            logprobs=None if one.stop else logprobs,
        )

    def drain(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Record the requests the scheduler ended since the last drain; returns `outputs`."""
        for req in self.scheduler.pop_finished():
            track = self.tracks.pop(req.request_id, None)
            if track is not None:
                self._record_finished(req, track)
        return outputs

    # --- failures and aborts -------------------------------------------------------------------------
    def fail(self, client_id: str, error: Exception, stage: str) -> list[RequestOutput]:
        """End every choice of client request `client_id` with finish reason "error", freeing its blocks.

        Returns the one output that carries `error` to the client (empty if the request is not live);
        `stage` (forward, sampling, output, step) is what the failure counters are labelled with.
        """
        tracks = [(rid, t) for rid, t in self.tracks.items() if t.client_id == client_id]
        if not tracks:
            return []
        sched = self.scheduler
        first = sched.requests.get(tracks[0][0])
        for rid, track in tracks:
            self._release_choices(rid)
            req = sched.abort(rid)
            if req is not None:
                self._record_finished(req, track, ERROR_FINISH_REASON)
                self.tracks.pop(rid, None)
            elif all(r.request_id != rid for r in sched.finished):
                self.tracks.pop(rid, None)  # a choice still waiting on its parent, never scheduled
            # else: a choice that finished normally earlier in this step; `drain` records it
        failures = self.counters.failures
        failures[stage] = failures.get(stage, 0) + 1
        head = tracks[0][1]
        return [
            RequestOutput(
                request_id=client_id,
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
        sched, tracks = self.scheduler, self.tracks
        suspects = list(sched.running) or list(sched.waiting)[:1]
        client_ids = dict.fromkeys(tracks[r.request_id].client_id for r in suspects if r.request_id in tracks)
        outputs: list[RequestOutput] = []
        for client_id in client_ids:
            outputs += self.fail(client_id, error, "step")
        return self.drain(outputs)

    def abort(self, client_id: str) -> None:
        """Drop every choice of `client_id`, freeing their blocks (a client that went away)."""
        for rid, track in list(self.tracks.items()):
            if track.client_id != client_id:
                continue
            self._release_choices(rid)
            req = self.scheduler.abort(rid)
            if req is not None:
                self._record_finished(req, track)
            self.tracks.pop(rid, None)

    def _release_choices(self, parent_id: str) -> None:
        for child in self.scheduler.release_choices(parent_id):
            self.tracks.pop(child.request_id, None)

    # --- figures -------------------------------------------------------------------------------------
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

    def pop_stats(self) -> tuple[list[FinishedStats], list[float]]:
        """Finished-request figures and inter-token latencies since the last call."""
        stats, self._finished_stats = self._finished_stats, []
        itl, self._itl = self._itl, []
        return stats, itl


def _error(token: int | Exception) -> Exception:
    """The error a row that failed to sample holds in place of its token."""
    if isinstance(token, Exception):
        return token
    raise AssertionError(f"a row sampled {token} but was not appended")
