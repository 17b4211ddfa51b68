"""Continuous batching with FCFS admission, a token budget per step and preemption by recompute.

One step, as in vLLM V1: first the running requests, in admission order, each get their next token (or the
next chunk of their prompt) within the token budget; a request that needs a block when none is free evicts
the most recently admitted running request (possibly itself), whose blocks are freed and which goes back to
the front of the queue to recompute. Only if nobody was preempted this step are waiting requests admitted,
first come first served, while `max_num_seqs`, the budget and memory allow. The head of the queue is never
skipped, so when it does not fit the reason is recorded (head-of-line blocking).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtune.core.allocators import AdmissionBlock, KVAllocator
from kvtune.core.forks import PendingChoices
from kvtune.core.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerConfig:
    """Knobs a serving engine exposes. `discard_output_on_preempt` is the seed's recompute-from-prompt."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    discard_output_on_preempt: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class Preemption:
    """One eviction: who needed the block, who was evicted, how many generated tokens went in the bin."""

    step: int
    needed_by: str
    victim: str
    discarded_tokens: int


@dataclass
class PrefixCacheStats:
    """vLLM's prefix-cache counters, in tokens: every request counts once, at its first admission.

    A recompute after preemption finds the request's own blocks again; that is no hit for the client, so
    it is not counted, nor is an n > 1 child forked onto its parent's prompt. The engine's
    `vllm:prefix_cache_*` metrics and the simulator both read these.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    def record(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_prompt_tokens
        self.hits += num_hit_tokens


def samples_now(req: Request) -> bool:
    """Who samples this step, said once for the engine, the simulator and the tests: a running request
    whose every known token is computed (a prompt's last chunk, or a decode)."""
    return req.status is RequestStatus.RUNNING and req.num_computed_tokens == req.num_tokens


@dataclass(frozen=True)
class Sampled:
    """A token one step sampled for `request`; `stop` when it is EOS or a stop token id (the output ends
    on it)."""

    request: Request
    token: int
    stop: bool = False


@dataclass
class SchedulerStep:
    """What one step runs: requests and how many tokens each computes, in order."""

    step: int
    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    blocked: AdmissionBlock | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def batch_order(self) -> list[int]:
        """Positions of the step's requests, decodes first, then prompt chunks (stable): the order a batch
        is computed in, so the order its rows sample in."""
        counts = self.num_tokens
        return sorted(range(len(counts)), key=lambda i: counts[i] != 1)

    def sampling_requests(self) -> list[Request]:
        """The requests this step samples the next token of (`samples_now`), in step order."""
        return [r for r in self.requests if samples_now(r)]


class Scheduler:
    """Owns the waiting queue and the running list; all memory goes through one `KVAllocator`."""

    def __init__(self, allocator: KVAllocator, config: SchedulerConfig | None = None) -> None:
        self.allocator = allocator
        self.config = config or SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_index = 0
        self.num_preemptions = 0
        self.discarded_tokens = 0
        self.preemption_log: deque[Preemption] = deque(maxlen=1024)
        self.prefix_cache = PrefixCacheStats()
        self.finished: list[Request] = []
        self.choices = PendingChoices()

    # --- queue management ----------------------------------------------------------------------------
    def add_request(self, req: Request, choices: Sequence[Request] = ()) -> None:
        """Queue a request; refuse one that could never fit in the whole pool (it would wait forever).

        `choices`: its n > 1 siblings, held until it first samples, then forked from its blocks.
        """
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        need = self.allocator.admission_need(req)
        if need > self.allocator.num_slots:
            raise ValueError(
                f"request {req.request_id} needs {need} KV slots but the whole pool has {self.allocator.num_slots}"
            )
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.choices.hold(req.request_id, list(choices))

    def fork_request(self, parent: Request, child: Request) -> bool:
        """Start `child` (same prompt, computed state) on `parent`'s blocks: n > 1 sampling shares the prompt.

        Only for a running parent whose prompt is computed; returns False when the policy cannot share,
        and then the child should be queued normally.
        """
        if child.request_id in self.requests:
            raise ValueError(f"duplicate request id {child.request_id!r}")
        if len(self.running) >= self.config.max_num_seqs:
            return False
        if parent.status is not RequestStatus.RUNNING or not self.allocator.fork(parent, child):
            return False
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        child.admitted_step = self.step_index
        self.requests[child.request_id] = child
        self.running.append(child)
        return True

    def release_choices(self, parent_id: str) -> list[Request]:
        """Forget the choices still waiting on `parent_id` (it failed or went away): never scheduled."""
        return self.choices.release(parent_id)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its memory (a client that went away)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_choices(self) -> int:
        """n > 1 choices waiting on their parent's first sample: queued work that `waiting` does not show."""
        return len(self.choices)

    # --- one step ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerStep:
        """Decide this step's batch. Advances `num_computed_tokens` for everything scheduled."""
        alloc = self.allocator
        running = self.running
        out = SchedulerStep(step=self.step_index)
        reqs, counts = out.requests, out.num_tokens
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget:
                n = budget
            if not alloc.can_append(req, n) and not self._grow_or_preempt(req, n, out):
                break  # req itself was evicted: it was the last running request
            reqs.append(req)
            counts.append(n)
            budget -= n
            i += 1
        if not out.preempted:
            budget = self._admit(out, budget)
        for req, n in zip(reqs, counts, strict=True):
            req.num_computed_tokens += n
            alloc.on_computed(req)
        out.copies = alloc.take_copies()
        self.step_index += 1
        return out

    def _grow_or_preempt(self, req: Request, n: int, out: SchedulerStep) -> bool:
        """Find room for `req`'s next tokens, evicting the newest running requests. False if `req` itself went."""
        while not self.allocator.grow(req, n):
            victim = self.running.pop()
            self._preempt(victim, needed_by=req)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit(self, out: SchedulerStep, budget: int) -> int:
        alloc = self.allocator
        waiting = self.waiting
        max_seqs = self.config.max_num_seqs
        while waiting:
            req = waiting[0]
            if len(self.running) >= max_seqs:
                out.blocked = AdmissionBlock("max_num_seqs")
                break
            if budget <= 0:
                out.blocked = AdmissionBlock("token_budget")
                break
            hit = alloc.computed_prefix_tokens(req)
            n = min(req.num_tokens - hit, budget)
            blocked = alloc.admit(req, n, hit)
            if blocked is not None:
                out.blocked = blocked
                break
            waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit
            req.num_cached_tokens = hit
            req.admitted_step = self.step_index
            if req.num_preemptions == 0:
                self.prefix_cache.record(req.num_prompt_tokens, hit)
            self.running.append(req)
            out.admitted.append(req)
            out.requests.append(req)
            out.num_tokens.append(n)
            budget -= n
        return budget

    def _preempt(self, victim: Request, needed_by: Request) -> None:
        self.allocator.free(victim)
        discarded = len(victim.output_token_ids) if self.config.discard_output_on_preempt else 0
        if discarded:
            victim.output_token_ids.clear()
            del victim.block_hashes[victim.num_prompt_tokens // self.allocator.block_size :]
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        self.discarded_tokens += discarded
        self.preemption_log.append(
            Preemption(self.step_index, needed_by.request_id, victim.request_id, discarded)
        )

    # --- results of a step ---------------------------------------------------------------------------
    def forks(
        self, step: SchedulerStep, faulted: Sequence[tuple[Request, int]] = ()
    ) -> list[tuple[Request, Request]]:
        """The waiting n > 1 choices that `update_from_output` forks after this step, as (child, parent): a
        query, so that the engine samples each child first, from its parent's logits row."""
        return self._plan_forks(step, faulted)[0] if self.choices else []

    def update_from_output(
        self, step: SchedulerStep, sampled: Iterable[Sampled], faulted: Sequence[tuple[Request, int]] = ()
    ) -> list[Request]:
        """Apply what `step` computed, once per step (vLLM's `Scheduler.update_from_output`), and return the
        requests it ended. Stop strings, which only text shows, end a request through `finish`.

        `faulted`: the chunks the step failed to compute, as (request, tokens in the chunk); their KV was
        never written, so no later request may take those blocks as a prefix hit. Then the choices waiting
        on a parent that samples now fork (`forks`; those without room are queued), and each sampled token
        is appended, ending its request on a stop token, max_tokens or its known length.
        """
        for req, count in faulted:
            self.allocator.withdraw_unwritten(req, req.num_computed_tokens - count)
        if self.choices:
            forked, queued = self._plan_forks(step, faulted)
            for child, parent in forked:
                self.choices.release(parent.request_id)
                if not self.fork_request(parent, child):
                    raise RuntimeError(f"choice {child.request_id} could not fork as planned")
            for child, parent in queued:
                self.choices.release(parent.request_id)
                self.add_request(child)
        finished = []
        for one in sampled:
            if self.append_token(one.request, one.token, eos=one.stop):
                finished.append(one.request)
        return finished

    def _plan_forks(
        self, step: SchedulerStep, faulted: Sequence[tuple[Request, int]]
    ) -> tuple[list[tuple[Request, Request]], list[tuple[Request, Request]]]:
        """(forked, queued), each as (child, parent): the choices of every parent sampling now (in batch order,
        its chunk not faulted) fork while a running slot is free and the allocator can share its KV."""
        lost = {req.request_id for req, _ in faulted}
        reqs = step.requests
        parents = [
            req
            for req in (reqs[i] for i in step.batch_order())
            if samples_now(req) and req.request_id not in lost
        ]
        room = self.config.max_num_seqs - len(self.running)
        forked: list[tuple[Request, Request]] = []
        queued: list[tuple[Request, Request]] = []
        for child, parent in self.choices.waiting_on(parents):
            if room > 0 and self.allocator.can_fork(parent):
                forked.append((child, parent))
                room -= 1
            else:
                queued.append((child, parent))
        return forked, queued

    def append_token(self, req: Request, token_id: int, eos: bool = False) -> bool:
        """Record a sampled token; finish the request on EOS, max_tokens or its known length. True if done."""
        req.output_token_ids.append(token_id)
        n_out = len(req.output_token_ids)
        if eos:
            self._finish(req, FinishReason.STOP)
        elif n_out >= req.max_tokens or (
            req.expected_output_len is not None and n_out >= req.expected_output_len
        ):
            self._finish(req, FinishReason.LENGTH)
        else:
            return False
        return True

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request for a reason only the engine can see (a stop string, say), wherever it is. One that
        its last token already ended (max_tokens) takes this reason: vLLM checks stop strings first."""
        if req.status is RequestStatus.FINISHED:
            req.finish_reason = reason
        else:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.allocator.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self.finished.append(req)

    def pop_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done
