"""LLMEngine on one background thread, with asyncio streams per request for the HTTP server.

The engine is not thread-safe, so only its own thread changes it: the server submits commands (add,
abort, reconfigure) to a queue that the thread drains between steps, and the thread hands each step's
outputs back to the event loop with `call_soon_threadsafe`. The HTTP layer does read a few engine fields
from the event loop (the model name, max_model_len, the tokenizer, `cap_setting`): the first are fixed after
boot and `cap_setting` is replaced whole, never mutated, so a read never sees half of one. torch releases the GIL during a forward pass,
so the event loop stays responsive while a batch runs. When there is no work the thread sleeps on an event
instead of spinning.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from kvtune.engine.loop.compute_threads import pin_current_thread
from kvtune.engine.loop.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from kvtune.engine.loop.llm_engine import LLMEngine
from kvtune.engine.loop.output import EngineCounters, FinishedStats, RequestOutput
from kvtune.engine.model.sampling import SamplingParams
from kvtune.errors import KvtuneError

logger = logging.getLogger(__name__)

T = TypeVar("T")


# Default waiting-queue bound, in multiples of the boot max_num_seqs. A waiting request starts only when a
# running one ends, so at 4x the newest waits behind about four full batches: past that, queueing only adds
# latency and memory, and a 429 lets the client (or a load balancer) back off or go to another replica.
DEFAULT_WAITING_PER_SEQ = 4
# --max-waiting-requests UNLIMITED_WAITING turns the bound off.
UNLIMITED_WAITING = -1


@dataclass
class EngineStats:
    """A consistent picture of the engine after one step, taken on the engine thread.

    Readers on other threads (metrics, logs, admission control, the admin API) use this copy instead of
    the live engine, whose containers change under them while a step runs.
    """

    counters: EngineCounters
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    effective_utilization: float
    held_empty_slots: int
    max_num_seqs: int
    max_tokens_cap: int | None
    finished: list[FinishedStats] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)  # refused at admission, by reason (monotonic)


def snapshot(engine: LLMEngine, drain: bool) -> EngineStats:
    """Copy the engine's figures; `drain` also takes the per-request stats gathered since the last drain."""
    c = engine.counters
    finished, itl = engine.pop_finished_stats() if drain else ([], [])
    return EngineStats(
        counters=EngineCounters(
            num_preemptions=c.num_preemptions,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            finished=dict(c.finished),
            failures=dict(c.failures),
        ),
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        kv_cache_usage=engine.kv_cache_usage,
        effective_utilization=engine.effective_utilization,
        held_empty_slots=engine.held_empty_slots,
        max_num_seqs=engine.max_num_seqs,
        max_tokens_cap=engine.max_tokens_cap,
        finished=finished,
        inter_token_latencies=itl,
    )


StatsListener = Callable[[EngineStats], None]


class RequestStream:
    """The outputs of one request, one list per engine step, until every choice has finished.

    Leaving it early (`aclose()`, the `async with` block ending, or the object being dropped) aborts the
    request on the engine thread, which frees its blocks: that is how a client that went away stops
    costing KV cache.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, n: int, whole: bool = False) -> None:
        """`whole`: the reader wants the answer only once it is complete (a non-streamed response), so the
        engine thread keeps the steps' outputs and hands them over in one list when every choice has finished,
        instead of waking the event loop for this request at every step."""
        self.request_id = request_id
        self.choices = n
        self.whole = whole
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list[RequestOutput] | BaseException] = asyncio.Queue()
        self.unfinished_on_engine = n  # counted down on the engine thread
        self.held: list[RequestOutput] = []  # engine thread: a whole stream's outputs, until it finishes
        self._unfinished = n  # counted down by the reader
        self._owner: AsyncEngine | None = owner

    def push(self, item: list[RequestOutput] | BaseException) -> None:
        """Engine thread: hand a step's outputs (or the request's failure) to the event loop."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    @property
    def finished(self) -> bool:
        return self._unfinished == 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self._unfinished == 0:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._unfinished = 0
            self._owner = None
            raise item
        self._unfinished -= sum(1 for out in item if out.finished)
        if self._unfinished == 0:
            self._owner = None
        return item

    def abort(self) -> None:
        """Drop the request unless it has already ended; safe to call twice and from any thread."""
        owner, self._owner = self._owner, None
        if owner is not None and self._unfinished:
            owner.abort_soon(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    def __del__(self) -> None:
        self.abort()


def deliver(ready: list[tuple[RequestStream, list[RequestOutput] | BaseException]]) -> None:
    """Engine thread: put each item in its stream's queue, waking each event loop once for all of them."""
    by_loop: dict[
        asyncio.AbstractEventLoop, list[tuple[RequestStream, list[RequestOutput] | BaseException]]
    ] = {}
    for stream, item in ready:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[RequestStream, list[RequestOutput] | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


class AsyncEngine:
    """Serve an LLMEngine to asyncio code: `add_request()` returns a stream of outputs, `call()` runs code on its thread."""

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int | None = None,
        engine_cores: frozenset[int] | None = None,
        compute_threads: int | None = None,
    ) -> None:
        """`max_waiting_requests`: None bounds the queue at DEFAULT_WAITING_PER_SEQ x the boot max_num_seqs,
        UNLIMITED_WAITING (-1) does not bound it, 0 refuses every new request, N > 0 allows N waiting.
        `engine_cores`: the cores the engine thread pins itself to (compute_threads.engine_cores).
        `compute_threads`: the torch threads the engine thread computes on, set from that thread (None: torch's
        setting as the thread inherits it)."""
        if max_waiting_requests is not None and max_waiting_requests < UNLIMITED_WAITING:
            raise KvtuneError(
                f"--max-waiting-requests must be >= 0, or {UNLIMITED_WAITING} for no limit; got {max_waiting_requests}"
            )
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        # The default bound is sized from the max_num_seqs the deployment declared, not the live value: when
        # the operator lowers max_num_seqs to stop preemptions, queued work must not turn into refusals.
        self._default_waiting_limit = DEFAULT_WAITING_PER_SEQ * engine.max_num_seqs
        self._rejected: dict[str, int] = {}  # guarded by _pending_lock
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # touched only on the engine thread
        self._pending_adds = 0  # submitted, not yet counted in `latest.num_waiting`
        self._added_since_publish = 0
        self._pending_lock = threading.Lock()
        self._listeners: list[StatsListener] = []
        self.latest: EngineStats = snapshot(engine, drain=False)
        self.engine_cores = engine_cores  # the engine thread's CPU affinity (None: wherever the OS puts it)
        self.compute_threads = compute_threads

    # --- lifecycle -----------------------------------------------------------------------------------
    def add_listener(self, listener: StatsListener) -> None:
        """`listener` runs on the engine thread after every step and command batch, with fresh figures."""
        self._listeners.append(listener)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvtune-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- commands --------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread between steps; the future holds its result or error."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        future: Future[T] = Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as err:  # the caller decides what an error means
                future.set_exception(err)

        self._commands.put(command)
        self._wake.set()
        return future

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    # --- requests --------------------------------------------------------------------------------------
    @property
    def waiting_limit(self) -> int | None:
        """The waiting-queue bound (None: unbounded); the default is sized from the boot max_num_seqs."""
        configured = self.max_waiting_requests
        if configured == UNLIMITED_WAITING:
            return None
        if configured is None:
            return self._default_waiting_limit
        return configured

    def check_capacity(self) -> None:
        """Raise EngineOverloadedError when one more request would push the waiting queue over its limit.

        Call with `_pending_lock` held. A refusal is counted and published promptly (a no-op command makes
        the engine thread publish even when it is idle).
        """
        limit = self.waiting_limit
        waiting = self.latest.num_waiting + self._pending_adds
        if limit is not None and waiting >= limit:
            self._rejected["queue_full"] = self._rejected.get("queue_full", 0) + 1
            if self.is_running:
                self._commands.put(lambda: None)
                self._wake.set()
            source = (
                f"{DEFAULT_WAITING_PER_SEQ} x max_num_seqs (the default of --max-waiting-requests)"
                if self.max_waiting_requests is None
                else "--max-waiting-requests"
            )
            raise EngineOverloadedError(
                f"the server is overloaded: {waiting} requests are waiting and the limit is {limit}, "
                f"{source}; retry later"
            )

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        prefix_key: str | None = None,
        whole: bool = False,
    ) -> RequestStream:
        """Queue a request; returns its output stream once the engine has accepted it (`cache_salt` and
        `prefix_key` as in `LLMEngine.add_request`; `whole`: see RequestStream).

        Raises ValueError for a request the engine cannot run (the caller's 400) and EngineOverloadedError
        when the waiting queue is full (429).
        """
        with self._pending_lock:
            self.check_capacity()
            self._pending_adds += 1
        stream = RequestStream(self, request_id, params.n, whole)
        arrival = time.monotonic()

        def add(engine: LLMEngine) -> None:
            try:
                engine.add_request(
                    request_id,
                    prompt_token_ids,
                    params,
                    arrival_time=arrival,
                    cache_salt=cache_salt,
                    prefix_key=prefix_key,
                )
            except BaseException:
                with self._pending_lock:
                    self._pending_adds -= 1
                raise
            self._added_since_publish += 1
            self._streams[request_id] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:
            # The caller went away while the add was queued; it may still run, so abort what it leaves.
            stream.abort()
            raise
        except BaseException:
            stream._owner = None
            raise
        return stream

    def abort_soon(self, request_id: str) -> None:
        """Abort from any thread without waiting for it (a closing stream cannot await)."""

        def abort(engine: LLMEngine) -> None:
            self._streams.pop(request_id, None)
            engine.abort_request(request_id)

        if self.is_running:
            self.submit(abort)

    # --- the engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        pin_current_thread(self.engine_cores)
        if self.compute_threads is not None:
            torch.set_num_threads(self.compute_threads)  # OpenMP's thread count is each thread's own setting
        engine = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            if self._drain_commands():
                self._publish()
            if not engine.has_unfinished_requests():
                self._wake.wait()
                continue
            try:
                outputs = engine.step()
            except Exception as err:
                # step() fails single requests itself; this is a fault outside those guards (scheduling,
                # bookkeeping). Fail the batch it was running, keep the queue, serve on.
                logger.exception("engine step failed; failing the requests it was running and serving on")
                outputs = self._fail_in_flight(err)
            self._dispatch(outputs)
            self._publish()
            if not outputs and engine.num_running == 0:
                # Nothing could be admitted (say, a fragmented contiguous pool): wait for news, do not spin.
                self._wake.wait(0.01)
        self._drain_commands()
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _drain_commands(self) -> bool:
        ran = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            command()

    def _fail_in_flight(self, err: Exception) -> list[RequestOutput]:
        try:
            return self.engine.fail_in_flight(err)
        except Exception:
            logger.exception("failing the requests in flight failed too; dropping every request")
            self._fail_all(RequestFailedError.of(err))
            return []

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand the step's outputs to their streams: every stream's in one wake of each event loop (one
        `call_soon_threadsafe`, not one per request), and a whole stream's only when it has finished."""
        by_request: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            by_request.setdefault(out.request_id, []).append(out)
        ready: list[tuple[RequestStream, list[RequestOutput] | BaseException]] = []
        for request_id, items in by_request.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            error = next((out.error for out in items if out.error is not None), None)
            if error is not None:
                ready.append((stream, RequestFailedError.of(error)))
                del self._streams[request_id]
                continue
            stream.unfinished_on_engine -= sum(1 for out in items if out.finished)
            done = stream.unfinished_on_engine <= 0
            if not stream.whole:
                ready.append((stream, items))
            elif done:
                ready.append((stream, [*stream.held, *items]))
                stream.held = []
            else:
                stream.held.extend(items)
            if done:
                del self._streams[request_id]
        deliver(ready)

    def _fail_all(self, failure: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.push(failure)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s after an engine failure failed", request_id)
        self._streams.clear()

    def _publish(self) -> None:
        stats = snapshot(self.engine, drain=True)
        with self._pending_lock:
            stats.rejected = dict(self._rejected)
            self.latest = stats
            self._pending_adds -= self._added_since_publish
            self._added_since_publish = 0
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("a stats listener failed")
