"""Prefix-defeat detection: prompts that share long content with earlier ones yet miss the prefix cache, and why.

A block-aligned prefix cache (vLLM's, SGLang's radix cache at block granularity, ours) serves block n only when a
prompt agrees with an earlier one on every token up to the end of block n (`prefix_hash`). Hit-rate metrics
cannot tell "nothing is shared" from "much is shared but the cache cannot see it"; this detector can, from the
token ids alone, and names the reason (`REASONS`) with a one-line fix (`fix_for`).

Per key (model, route or tenant) it keeps bounded LRU maps: block chain hashes (salted and plain, with the last
use time: what the cache would serve), token-level prefix hashes of each prompt's head (the exact common prefix),
content-defined k-gram anchors (shared runs at any offset) and the recent start positions of each shared run
(to tell a varying head from a shifted document). Every prompt costs O(its tokens).

Memory: at most `DetectorLimits.max_state_entries()` entries (the sum of the per-key caps over `max_keys` keys,
plus the examples), and at most `DetectorLimits.max_state_bytes()` bytes, i.e. `BYTES_PER_ENTRY` (256) bytes
per entry plus `FIXED_BYTES` (64 KiB); with the default limits that is 24,832 entries per key, 16 keys:
397,337 entries and 102 MB at the very most (an entry measures about 185 bytes with tracemalloc, so a full
detector holds about 73 MB; one busy key about 4.6 MB). tests/core/test_prefix_defeats.py checks the bound.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtune.core.fingerprints import is_sampled_anchor, kgram_anchors, prefix_hashes, stable_digest
from kvtune.core.prefix_hash import ROOT_HASH, hash_block_tokens, prompt_block_hashes
from kvtune.core.request import Request

REASONS: tuple[str, ...] = ("varying_head", "shorter_than_block", "misaligned", "salted", "evicted")

# The stated byte bound per state entry (an OrderedDict slot, its int key and value), and for the rest.
BYTES_PER_ENTRY = 256
FIXED_BYTES = 64 * 1024
# Anchor values pack the 32-bit context hash above a 24-bit position; tokens beyond it get no anchors.
_POSITION_BITS = 24
_MAX_ANCHOR_POSITION = (1 << _POSITION_BITS) - 1


@dataclass(frozen=True)
class DetectorLimits:
    """How much the detector remembers; every cap is in entries, so the memory bound follows from them."""

    max_keys: int = 16
    max_blocks_per_key: int = 8192  # block chain hashes, salted and plain (what the cache would serve)
    max_prefixes_per_key: int = 8192  # token-level prefix hashes of prompt heads (exact common prefix)
    max_anchors_per_key: int = 8192  # k-gram anchors (shared runs at any offset)
    max_runs_per_key: int = 256  # shared runs with their recent start positions
    examples_per_reason: int = 5
    head_tokens: int = 64  # tokens of each prompt's head hashed token by token (at least 2 blocks are)
    kgram: int = 12  # tokens per anchor k-gram
    anchor_sample: int = 8  # beyond the head, about one position in this many is an anchor
    min_shared_tokens: int = 32  # a shared run shorter than this (or than 2 blocks) is not worth a finding
    shift_tolerance: int = 8  # median shift (tokens) up to which a shared run counts as "at the same place"
    max_varying_span: int = 32  # tokens: a longer differing span before a shared run is a preamble
    run_history: int = 5  # start positions kept per shared run, for the median shift
    # percent of this prompt's anchors inside a candidate run that must match the earlier prompt at the run's
    # shift: a real shared run matches nearly all (0.65 on a text of ten words repeated, ~1.0 on real text),
    # chance k-gram matches of repetitive text that line up by luck match a quarter
    min_run_density_pct: int = 50

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < (0 if name == "shift_tolerance" else 1):
                raise ValueError(f"DetectorLimits.{name} must be a positive integer, got {value!r}")

    def per_key_entries(self) -> int:
        return (
            self.max_blocks_per_key
            + self.max_prefixes_per_key
            + self.max_anchors_per_key
            + self.max_runs_per_key
        )

    def max_state_entries(self) -> int:
        """The stated bound on `PrefixDefeatDetector.state_entries()`."""
        return self.max_keys * self.per_key_entries() + len(REASONS) * self.examples_per_reason

    def max_state_bytes(self) -> int:
        """The stated bound on the detector's memory, in bytes (measured with tracemalloc in the tests)."""
        return self.max_state_entries() * BYTES_PER_ENTRY + FIXED_BYTES

    def head_length(self, block_size: int) -> int:
        return max(2 * block_size, self.head_tokens)

    def to_json(self) -> dict[str, int]:
        return {
            **asdict(self),
            "max_state_entries": self.max_state_entries(),
            "max_state_bytes": self.max_state_bytes(),
        }


@dataclass(frozen=True)
class DefeatFinding:
    """One prompt that missed the cache for a nameable reason. Positions are token indices in this prompt."""

    reason: str  # one of REASONS
    tokens_lost: int  # prompt tokens that would have hit the prefix cache
    span_start: int  # varying_head / misaligned: first token of the varying span
    span_length: int  # (shorter_than_block: the shared prefix; salted / evicted: the missed run)
    shared_start: int  # where the shared run starts in this prompt
    shared_length: int
    offset_shift: int = 0  # misaligned: shift of the shared run against the earlier prompt (tokens)
    since_last_use_s: float | None = None  # evicted: how long ago the blocks were last used
    prompt_hash: str = ""  # short stable hex hash of the prompt's ids (never the text)
    shared_hash: str = ""  # short stable hex hash of the shared run
    span_token_ids: tuple[int, ...] | None = None  # only with keep_span_tokens=True (opt-in text)
    block_size: int = 0  # the block size the prompt was judged against

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "reason": self.reason,
            "tokens_lost": self.tokens_lost,
            "span_start": self.span_start,
            "span_length": self.span_length,
            "shared_start": self.shared_start,
            "shared_length": self.shared_length,
            "prompt_hash": self.prompt_hash,
            "shared_hash": self.shared_hash,
        }
        if self.reason == "misaligned":
            out["offset_shift"] = self.offset_shift
            if self.block_size:
                out["offset_shift_mod_block"] = self.offset_shift % self.block_size
        if self.since_last_use_s is not None:
            out["since_last_use_s"] = round(self.since_last_use_s, 3)
        if self.span_token_ids is not None:
            out["span_token_ids"] = list(self.span_token_ids)
        return out


def fix_for(reason: str, block_size: int, finding: DefeatFinding | None = None) -> str:
    """The one-line remedy for `reason`, with this finding's figures when one is given."""
    f = finding
    if reason == "varying_head":
        where = f" (tokens {f.span_start}-{f.span_start + f.span_length - 1})" if f and f.span_length else ""
        return f"move the varying span{where} (timestamp, request id, user name) after the shared prompt"
    if reason == "shorter_than_block":
        n = f"{f.shared_length} tokens" if f else "shorter than one block"
        return (
            f"the shared prefix is {n}, under one block of {block_size}: lengthen it or use a smaller block"
        )
    if reason == "misaligned":
        shift = f" (it moves by {f.offset_shift} tokens between prompts)" if f else ""
        return f"put the shared document before the variable-length preamble{shift}"
    if reason == "salted":
        return "use one cache_salt per tenant, not per request"
    if reason == "evicted":
        ago = f"{f.since_last_use_s:.1f} s" if f and f.since_last_use_s is not None else "shortly"
        return (
            f"the blocks were evicted {ago} before reuse: more KV memory (FP8 KV, larger "
            "gpu_memory_utilization) or fewer concurrent sequences"
        )
    raise ValueError(f"unknown prefix-defeat reason {reason!r}")


def _remember(table: OrderedDict[int, Any], key: int, value: Any) -> None:
    table[key] = value
    table.move_to_end(key)


def _trim(table: OrderedDict[int, Any], cap: int) -> None:
    for _ in range(len(table) - cap):
        table.popitem(last=False)


def _chains(positions: list[int], max_gap: int) -> list[tuple[int, int]]:
    """(first, last) of each chain of ascending positions whose neighbours are at most `max_gap` apart."""
    chains = []
    start = prev = positions[0]
    for pos in positions[1:]:
        if pos - prev > max_gap:
            chains.append((start, prev))
            start = pos
        prev = pos
    chains.append((start, prev))
    return chains


def leading_hits(hashes: Sequence[int], table: Container[int]) -> int:
    """How many of `hashes`, from the first, are in `table`: the blocks a prefix cache would hit."""
    n = 0
    for h in hashes:
        if h not in table:
            break
        n += 1
    return n


def cached_at_admission(
    firsts: Sequence[Request], scheduled: Sequence[Request], counts: Sequence[int], block_size: int
) -> list[int]:
    """The prefix-cache hit an engine shows the detector for each prompt of `firsts`, admitted for the first
    time in a step that computes `scheduled` (`counts` tokens each).

    The cache publishes a block only once a step has scheduled it, so a prompt admitted beside another with
    the same prefix (earlier in this step, or one still in prefill) misses blocks that were never cached, not
    evicted: those count as hits here, so `evicted` means evicted.
    """
    first_ids = {r.request_id for r in firsts}
    in_flight: set[int] = set()
    for req, n in zip(scheduled, counts, strict=True):
        if n > 1 and req.request_id not in first_ids:
            in_flight.update(req.block_hashes)  # a prompt (re)computing: its tail is not cached yet
    cached = []
    for req in firsts:
        hashes = req.block_hashes
        blocks = req.num_cached_tokens // block_size
        most = (req.num_prompt_tokens - 1) // block_size
        while blocks < min(most, len(hashes)) and hashes[blocks] in in_flight:
            blocks += 1
        cached.append(max(req.num_cached_tokens, blocks * block_size))
        in_flight.update(hashes)
    return cached


@dataclass
class _KeyState:
    blocks: OrderedDict[int, float] = field(default_factory=OrderedDict)  # chain hash -> last use
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)
    anchors: OrderedDict[int, int] = field(
        default_factory=OrderedDict
    )  # k-gram hash -> context<<24 | position
    runs: OrderedDict[int, tuple[int, ...]] = field(
        default_factory=OrderedDict
    )  # run anchor -> recent starts

    def entries(self) -> int:
        return len(self.blocks) + len(self.prefixes) + len(self.anchors) + len(self.runs)


@dataclass(frozen=True)
class _SharedRun:
    start: int  # in this prompt
    end: int
    shift: int  # start here minus start in the earlier prompt
    signature: int  # the anchor that names the run across prompts


@dataclass
class _Prompt:
    """One prompt's fingerprints, computed once per observe."""

    ids: Sequence[int]
    plain: list[int]  # block chain hashes from the root
    salted: list[int]  # ditto from the salted root (the same list without a salt)
    prefix: list[int]  # token-level prefix hashes of the head
    anchors: list[tuple[int, int]]
    head: int

    def context(self, position: int, block_size: int) -> int:
        """32 bits naming everything before `position` (exact in the head, up to the block boundary beyond)."""
        if position == 0:
            return 0
        if position <= self.head:
            return self.prefix[position - 1] & 0xFFFFFFFF
        return self.plain[position // block_size - 1] & 0xFFFFFFFF


class PrefixDefeatDetector:
    """Watches prompts per key and reports those that miss the prefix cache for a nameable reason.

    Thread-safe: fronts call `observe` from worker threads and `report` from the HTTP handler."""

    def __init__(
        self,
        block_size: int,
        limits: DetectorLimits | None = None,
        keep_span_tokens: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.limits = limits or DetectorLimits()
        self.keep_span_tokens = keep_span_tokens
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, _KeyState] = OrderedDict()
        self._counts = {reason: [0, 0] for reason in REASONS}
        self._examples: dict[str, deque[DefeatFinding]] = {
            reason: deque(maxlen=self.limits.examples_per_reason) for reason in REASONS
        }
        self.observed = 0
        self.observe_seconds = 0.0  # wall time spent in observe, cumulative

    # ---- public API -------------------------------------------------------------------------------------------

    def observe(
        self,
        key: str,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        cached_tokens: int | None = None,
    ) -> DefeatFinding | None:
        """Judge one prompt against the earlier ones under `key`, then remember it. O(len(token_ids)).

        cached_tokens: the engine's actual prefix-cache hit for this prompt (engine only; enables `evicted`).
        The proxy passes None."""
        started = time.perf_counter()
        prompt = self._fingerprint(token_ids, cache_salt)
        with self._lock:
            self.observed += 1
            now = self._clock()
            state = self._state_for(key)
            finding = self._judge(state, prompt, cache_salt, cached_tokens, now)
            self._learn(state, prompt, now)
            if finding is not None:
                self._counts[finding.reason][0] += 1
                self._counts[finding.reason][1] += finding.tokens_lost
                self._examples[finding.reason].append(finding)
            # Its own cost, exported by the fronts: what the detector takes from the engine is measured
            # where it runs, not inferred from a throughput A/B whose noise is larger than the cost.
            self.observe_seconds += time.perf_counter() - started
            return finding

    def counts(self) -> dict[str, tuple[int, int]]:
        """reason -> (defeats, tokens lost), for every reason; both only ever grow."""
        with self._lock:
            return {reason: (c[0], c[1]) for reason, c in self._counts.items()}

    def report(self) -> dict[str, Any]:
        """The JSON of `GET /kvtune/prefix-report`."""
        with self._lock:
            reasons = {
                reason: {
                    "defeats": self._counts[reason][0],
                    "tokens_lost": self._counts[reason][1],
                    "examples": [f.to_json() for f in self._examples[reason]],
                }
                for reason in REASONS
            }
            fixes = {
                reason: fix_for(
                    reason, self.block_size, self._examples[reason][-1] if self._examples[reason] else None
                )
                for reason in REASONS
            }
            return {
                "block_size": self.block_size,
                "observed": self.observed,
                "observe_seconds": round(self.observe_seconds, 6),
                "keys": len(self._keys),
                "limits": self.limits.to_json(),
                "reasons": reasons,
                "fixes": fixes,
            }

    def state_entries(self) -> int:
        """Entries held now; never more than `limits.max_state_entries()`."""
        with self._lock:
            return sum(s.entries() for s in self._keys.values()) + sum(
                len(e) for e in self._examples.values()
            )

    # ---- internals --------------------------------------------------------------------------------------------

    def _fingerprint(self, token_ids: Sequence[int], cache_salt: str | None) -> _Prompt:
        b, lim = self.block_size, self.limits
        head = lim.head_length(b)
        plain = prompt_block_hashes(token_ids, b)
        salted = plain
        if cache_salt is not None:
            salted = prompt_block_hashes(
                token_ids, b, parent=hash_block_tokens(ROOT_HASH, _salt_ids(cache_salt))
            )
        return _Prompt(
            ids=token_ids,
            plain=plain,
            salted=salted,
            prefix=prefix_hashes(token_ids, head),
            anchors=kgram_anchors(token_ids, lim.kgram, lim.anchor_sample, head),
            head=head,
        )

    def _state_for(self, key: str) -> _KeyState:
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState()
            while len(self._keys) > self.limits.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        return state

    def _judge(
        self, state: _KeyState, p: _Prompt, salt: str | None, cached_tokens: int | None, now: float
    ) -> DefeatFinding | None:
        b = self.block_size
        n = len(p.ids)
        # An engine computes at least the last token, so a full hit gives back its last block.
        max_hit = (n - 1) // b if n else 0
        cache_hit = leading_hits(p.salted[:max_hit], state.blocks)
        content_hit = leading_hits(p.plain[:max_hit], state.blocks)
        if cached_tokens is not None and 0 <= cached_tokens < cache_hit * b:
            first_missed = cached_tokens // b
            last_use = state.blocks[p.salted[first_missed]]
            return self._finding(
                p, "evicted", cache_hit * b - cached_tokens, cached_tokens, cache_hit * b - cached_tokens,
                0, cache_hit * b, since_last_use_s=max(0.0, now - last_use),
            )  # fmt: skip
        if salt is not None and content_hit > cache_hit:
            missed = (content_hit - cache_hit) * b
            return self._finding(p, "salted", missed, cache_hit * b, missed, 0, content_hit * b)
        lcp = leading_hits(p.prefix, state.prefixes)
        run = self._shared_run(state, p, covered=cache_hit * b)
        if run is not None:
            span_start = max(min(lcp, run.start), cache_hit * b)
            shared = run.end - run.start
            lost = ((span_start + shared) // b - cache_hit) * b
            if lost > 0:
                reason = self._varying_or_misaligned(state, run, run.start - span_start)
                return self._finding(
                    p, reason, lost, span_start, run.start - span_start, run.start, shared,
                    offset_shift=run.shift,
                )  # fmt: skip
        if content_hit == 0 and max(8, b // 2) <= lcp < min(b, n):
            return self._finding(p, "shorter_than_block", lcp, 0, lcp, 0, lcp)
        return None

    def _shared_run(self, state: _KeyState, p: _Prompt, covered: int) -> _SharedRun | None:
        """The longest run of this prompt that an earlier prompt holds at another position or after other
        tokens (so the cache cannot serve it), beyond the `covered` tokens the cache does serve."""
        b, lim = self.block_size, self.limits
        by_shift: dict[int, list[int]] = {}
        hashes: dict[int, int] = {}
        for pos, h in p.anchors:
            if pos < covered:
                continue
            packed = state.anchors.get(h)
            if packed is None:
                continue
            earlier = packed & _MAX_ANCHOR_POSITION
            if earlier == pos and packed >> _POSITION_BITS == p.context(pos, b):
                continue  # the same tokens up to here, at the same place: the cache serves it (or forgot it)
            by_shift.setdefault(pos - earlier, []).append(pos)
            hashes[pos] = h
        own = [pos for pos, _ in p.anchors if pos >= covered]  # ascending
        best: tuple[int, int, int] | None = None  # (start, last anchor, shift)
        for shift, positions in by_shift.items():
            for start, last in _chains(positions, max_gap=lim.kgram + 16 * lim.anchor_sample):
                if best is not None and last - start <= best[1] - best[0]:
                    continue
                support = bisect_right(positions, last) - bisect_left(positions, start)
                candidates = bisect_right(own, last) - bisect_left(own, start)
                if 100 * support >= lim.min_run_density_pct * candidates:
                    best = (start, last, shift)
        if best is None:
            return None
        start, last, shift = best
        end = last + lim.kgram
        if end - max(start, covered) < max(2 * b, lim.min_shared_tokens):
            return None
        return _SharedRun(start, end, shift, self._signature(p, hashes, start, last))

    def _signature(self, p: _Prompt, hashes: dict[int, int], first: int, last: int) -> int:
        """The first sampled anchor of a run: the same k-gram whatever precedes the run, dense head or not."""
        for pos in range(first, last + 1):
            h = hashes.get(pos)
            if h is not None and is_sampled_anchor(p.ids[pos], self.limits.anchor_sample):
                return h
        return hashes[first]

    def _varying_or_misaligned(self, state: _KeyState, run: _SharedRun, span_length: int) -> str:
        """A short span (a timestamp, an id, a name) before a run that stays in place is a varying head; a
        long one, or a run that moves between prompts, is a preamble that shifts the shared content."""
        steady = abs(self._median_shift(state, run)) <= self.limits.shift_tolerance
        return "varying_head" if steady and span_length <= self.limits.max_varying_span else "misaligned"

    def _median_shift(self, state: _KeyState, run: _SharedRun) -> int:
        """The median shift of this run's start against its recent earlier starts (then remembers this one)."""
        history = state.runs.get(run.signature) or (run.start - run.shift,)
        shifts = sorted(run.start - s for s in history)
        _remember(state.runs, run.signature, (*history, run.start)[-self.limits.run_history :])
        _trim(state.runs, self.limits.max_runs_per_key)
        return shifts[len(shifts) // 2]

    def _learn(self, state: _KeyState, p: _Prompt, now: float) -> None:
        lim, blocks = self.limits, state.blocks
        for h in p.plain:
            _remember(blocks, h, now)
        if p.salted is not p.plain:
            for h in p.salted:
                _remember(blocks, h, now)
        _trim(blocks, lim.max_blocks_per_key)
        for h in p.prefix:
            _remember(state.prefixes, h, None)
        _trim(state.prefixes, lim.max_prefixes_per_key)
        b = self.block_size
        for pos, h in p.anchors:
            if pos <= _MAX_ANCHOR_POSITION:
                _remember(state.anchors, h, (p.context(pos, b) << _POSITION_BITS) | pos)
        _trim(state.anchors, lim.max_anchors_per_key)

    def _finding(
        self,
        p: _Prompt,
        reason: str,
        tokens_lost: int,
        span_start: int,
        span_length: int,
        shared_start: int,
        shared_length: int,
        offset_shift: int = 0,
        since_last_use_s: float | None = None,
    ) -> DefeatFinding:
        span = tuple(p.ids[span_start : span_start + span_length]) if self.keep_span_tokens else None
        return DefeatFinding(
            reason=reason,
            tokens_lost=tokens_lost,
            span_start=span_start,
            span_length=span_length,
            shared_start=shared_start,
            shared_length=shared_length,
            offset_shift=offset_shift,
            since_last_use_s=since_last_use_s,
            prompt_hash=stable_digest(p.ids),
            shared_hash=stable_digest(p.ids, shared_start, shared_start + shared_length),
            span_token_ids=span,
            block_size=self.block_size,
        )


def _salt_ids(cache_salt: str) -> tuple[int, ...]:
    """The salt as ints mixed into the root block's parent, like vLLM's cache_salt (deterministic: no str hash)."""
    return tuple(cache_salt.encode("utf-8", "surrogatepass"))
