"""Allocation policies: where a sequence's KV slots come from.

- `paged`: a block when a sequence fills its last one (vLLM). Admission needs only the prompt's blocks,
  so the pool can run dry mid-generation, and the scheduler must preempt.
- `contiguous`: at admission one run of consecutive blocks for prompt + declared max_tokens (optionally
  rounded up to a power of two), placed first-fit (Orca-style). Holes appear between reservations.
- `oracle`: contiguous, sized by the request's true output length, which only a simulator knows.

Every policy works in whole blocks so the engine's kernels can address any of them through a block table.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvtune.core.block_pool import BlockPool
from kvtune.core.geometry import check_block_size
from kvtune.core.prefix_hash import hash_block_tokens, prompt_block_hashes, salted_root
from kvtune.core.request import Request

POLICIES = ("paged", "contiguous", "oracle")


@dataclass(frozen=True)
class AdmissionBlock:
    """Why the request at the head of the queue could not start this step.

    `reason` is one of "memory" (too few free slots), "external_fragmentation" (enough free slots, but no
    run of consecutive slots is large enough), "max_num_seqs" or "token_budget".
    """

    reason: str
    slots_needed: int = 0
    slots_free: int = 0
    free_runs: int = 0
    largest_run: int = 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


class KVAllocator(ABC):
    """The interface the scheduler uses. All sizes the scheduler sees are in tokens."""

    name: str

    def __init__(self, num_blocks: int, block_size: int) -> None:
        check_block_size(block_size)
        if num_blocks <= 0:
            raise ValueError(f"the pool must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Per running request, the slots it may write without the allocator acting (allocating or copying).
        self._writable: dict[str, int] = {}
        # Sum over running requests of slots held past their final length: never reached, known waste.
        self.internal_slots = 0
        self._excess: dict[str, int] = {}
        # Copies (src_block, dst_block) the runner must perform before the next forward pass.
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def capacity(self) -> Mapping[str, int]:
        """Read-only: per running request, the slots it may write before `grow` must allocate or copy."""
        return MappingProxyType(self._writable)

    def can_append(self, req: Request, num_new_tokens: int) -> bool:
        """True when `req` can compute `num_new_tokens` more tokens in what it holds, with no `grow`.

        The scheduler's fast path: most decode steps write into a block the request already owns.
        """
        return req.num_computed_tokens + num_new_tokens <= self._writable[req.request_id]

    def take_copies(self) -> list[tuple[int, int]]:
        """Hand the runner the (src_block, dst_block) copies to perform before the next forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    @property
    def shared_slots(self) -> int:
        """Slots that sequences share (prefix hits, forks): each sharer counts them, the pool holds them once."""
        return 0

    @property
    @abstractmethod
    def slots_held(self) -> int:
        """Slots held by running requests (shared blocks once)."""

    @property
    @abstractmethod
    def free_slots(self) -> int:
        """Slots a new request could use (cached-but-unused blocks count as free)."""

    def admission_need(self, req: Request) -> int:
        """Slots this request needs to be admitted at all: the check for 'larger than the whole pool'."""
        return _ceil_div(req.num_prompt_tokens + 1, self.block_size) * self.block_size

    def computed_prefix_tokens(self, req: Request) -> int:
        """Prompt tokens already in the cache (a prefix-cache hit); 0 for policies without one."""
        return 0

    @abstractmethod
    def admit(self, req: Request, num_new_tokens: int, num_hit_tokens: int) -> AdmissionBlock | None:
        """Allocate for a waiting request about to compute `num_new_tokens` after `num_hit_tokens` hits.

        Returns None on success, else why it cannot start.
        """

    @abstractmethod
    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens. False: the pool is out of memory."""

    @abstractmethod
    def free(self, req: Request) -> None:
        """Return everything `req` holds."""

    @abstractmethod
    def block_table(self, req: Request) -> list[int]:
        """Physical block ids of `req`'s logical blocks 0, 1, ..."""

    @property
    def num_table_entries(self) -> int:
        """Block-table entries across running requests (a shared block appears in each sharer's table)."""
        return self.slots_held // self.block_size

    def on_computed(self, req: Request) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Called after `req.num_computed_tokens` advanced: lets a caching policy publish full blocks."""

    def withdraw_unwritten(self, req: Request, num_written: int) -> None:  # noqa: B027 (optional hook)
        """The runner failed to write `req`'s tokens from `num_written` on: unpublish any block holding them."""

    def can_fork(self, parent: Request) -> bool:
        """Whether `fork` would share `parent`'s KV: asked before a step samples a child from its parent."""
        return False

    def fork(self, parent: Request, child: Request) -> bool:
        """Let `child` share `parent`'s KV (n > 1 sampling). False when the policy cannot share."""
        return False

    def _set_excess(self, req: Request, capacity: int) -> None:
        excess = max(0, capacity - req.final_length)
        self.internal_slots += excess - self._excess.get(req.request_id, 0)
        self._excess[req.request_id] = excess

    def _drop_excess(self, req: Request) -> None:
        self.internal_slots -= self._excess.pop(req.request_id, 0)


class PagedAllocator(KVAllocator):
    """vLLM's policy: blocks on demand from a `BlockPool`, with prefix caching and copy-on-write."""

    name = "paged"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size)
        self.pool = BlockPool(num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}
        self._pending_hits: dict[str, list[int]] = {}

    @property
    def slots_held(self) -> int:
        return self.pool.num_used_blocks * self.block_size

    @property
    def free_slots(self) -> int:
        return self.pool.num_free_blocks * self.block_size

    @property
    def num_table_entries(self) -> int:
        return self.pool.num_used_blocks + self.pool.num_shared_refs

    @property
    def shared_slots(self) -> int:
        return self.pool.num_shared_refs * self.block_size

    def _ensure_prompt_hashes(self, req: Request) -> None:
        """Extend `req.block_hashes` over every full prompt block (kept across preemptions), chained from
        the request's salted root."""
        hashes = req.block_hashes
        if len(hashes) >= req.num_prompt_tokens // self.block_size:
            return
        parent = hashes[-1] if hashes else salted_root(req.cache_salt)
        hashes += prompt_block_hashes(req.prompt_token_ids, self.block_size, start=len(hashes), parent=parent)

    def computed_prefix_tokens(self, req: Request) -> int:
        if not self.enable_prefix_caching:
            return 0
        self._ensure_prompt_hashes(req)
        hits: list[int] = []
        # At least one token must be computed to produce logits, so a full hit gives back its last block.
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        for h in req.block_hashes[:max_hit_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        self._pending_hits[req.request_id] = hits
        return len(hits) * self.block_size

    def admit(self, req: Request, num_new_tokens: int, num_hit_tokens: int) -> AdmissionBlock | None:
        hits = self._pending_hits.pop(req.request_id, [])[: num_hit_tokens // self.block_size]
        total = num_hit_tokens + num_new_tokens
        n_new = _ceil_div(total, self.block_size) - len(hits)
        evictable_hits = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if n_new + evictable_hits > self.pool.num_free_blocks:
            return AdmissionBlock(
                "memory",
                slots_needed=(n_new + evictable_hits) * self.block_size,
                slots_free=self.free_slots,
                free_runs=1 if self.pool.num_free_blocks else 0,
                largest_run=self.free_slots,
            )
        for b in hits:
            self.pool.touch(b)
        blocks = hits + self.pool.allocate(n_new)
        rid = req.request_id
        self.blocks[rid] = blocks
        self._num_published[rid] = len(hits)
        capacity = len(blocks) * self.block_size
        self._writable[rid] = capacity
        self._set_excess(req, capacity)
        return None

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        rid = req.request_id
        blocks = self.blocks[rid]
        bs = self.block_size
        computed = req.num_computed_tokens
        # Copy-on-write: the partial last block is shared with a fork, and we are about to write into it.
        cow = bool(computed % bs) and self.pool.ref_cnt[blocks[-1]] > 1
        need = _ceil_div(computed + num_new_tokens, bs) - len(blocks)
        if need + cow > self.pool.num_free_blocks:
            return False
        if cow:
            (copy,) = self.pool.allocate(1)
            self._pending_copies.append((blocks[-1], copy))
            self.pool.release(blocks[-1])
            blocks[-1] = copy
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        capacity = len(blocks) * bs
        self._writable[rid] = capacity
        self._set_excess(req, capacity)
        return True

    def on_computed(self, req: Request) -> None:
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        n_full = req.num_computed_tokens // self.block_size
        done = self._num_published[rid]
        if n_full <= done:
            return
        self._ensure_prompt_hashes(req)
        hashes = req.block_hashes
        bs = self.block_size
        blocks = self.blocks[rid]
        for b in range(done, n_full):
            if b >= len(hashes):
                parent = hashes[-1] if hashes else salted_root(req.cache_salt)
                hashes.append(
                    hash_block_tokens(parent, [req.token_at(i) for i in range(b * bs, (b + 1) * bs)])
                )
            self.pool.cache(blocks[b], hashes[b])
        self._num_published[rid] = n_full

    def withdraw_unwritten(self, req: Request, num_written: int) -> None:
        rid = req.request_id
        blocks = self.blocks.get(rid)
        if blocks is None or not self.enable_prefix_caching:
            return
        first = num_written // self.block_size
        published = self._num_published[rid]
        for b in range(first, published):
            self.pool.uncache(blocks[b])
        self._num_published[rid] = min(published, first)

    def free(self, req: Request) -> None:
        rid = req.request_id
        blocks = self.blocks.pop(rid, None)
        if blocks is None:
            return
        self.pool.release_all(blocks)
        self._num_published.pop(rid, None)
        self._writable.pop(rid, None)
        self._drop_excess(req)

    def block_table(self, req: Request) -> list[int]:
        return self.blocks[req.request_id]

    def can_fork(self, parent: Request) -> bool:
        return parent.request_id in self.blocks

    def fork(self, parent: Request, child: Request) -> bool:
        blocks = list(self.blocks[parent.request_id])
        for b in blocks:
            self.pool.touch(b)
        rid = child.request_id
        self.blocks[rid] = blocks
        self._num_published[rid] = self._num_published[parent.request_id]
        child.block_hashes = list(parent.block_hashes)
        held = len(blocks) * self.block_size
        self._writable[rid] = held
        if parent.num_computed_tokens % self.block_size:
            self._copy_on_write(parent.request_id, parent.num_computed_tokens)
            self._copy_on_write(rid, parent.num_computed_tokens)
        self._set_excess(child, held)
        return True

    def _copy_on_write(self, request_id: str, written: int) -> None:
        """Make a shared partial last block read-only: writes end at the `written` edge, so the next one
        goes through `grow`, which gives the writer a copy of its own first."""
        self._writable[request_id] = written

    def admission_need(self, req: Request) -> int:
        """A paged request must be able to grow to its final length alone in the pool, or it never ends.

        The last sampled token is never written to the cache, hence the minus one.
        """
        need = max(req.num_prompt_tokens + 1, req.final_length - 1)
        return _ceil_div(need, self.block_size) * self.block_size


class ContiguousAllocator(KVAllocator):
    """One run of consecutive blocks per request, reserved at admission and placed first-fit.

    `oracle=True` sizes the run by the true output length instead of the declared `max_tokens`.
    """

    def __init__(
        self, num_blocks: int, block_size: int, round_pow2: bool = True, oracle: bool = False
    ) -> None:
        super().__init__(num_blocks, block_size)
        self.round_pow2 = round_pow2
        self.oracle = oracle
        self.name = "oracle" if oracle else "contiguous"
        # Free runs of blocks, sorted by start: parallel lists so first-fit is a scan and freeing a bisect.
        self._run_starts: list[int] = [0]
        self._run_lens: list[int] = [num_blocks]
        self._free_blocks = num_blocks
        self.runs: dict[str, tuple[int, int]] = {}

    @property
    def slots_held(self) -> int:
        return (self.num_blocks - self._free_blocks) * self.block_size

    @property
    def free_slots(self) -> int:
        return self._free_blocks * self.block_size

    @property
    def free_runs(self) -> list[tuple[int, int]]:
        """(start block, length in blocks) of every hole, in address order."""
        return list(zip(self._run_starts, self._run_lens, strict=True))

    def reservation_slots(self, req: Request) -> int:
        """Slots reserved at admission: prompt + declared (or, for the oracle, true) output length."""
        out = req.max_tokens
        if self.oracle and req.expected_output_len is not None:
            out = min(req.expected_output_len, req.max_tokens)
        slots = req.num_prompt_tokens + out
        return _next_pow2(slots) if self.round_pow2 else slots

    def admission_need(self, req: Request) -> int:
        return _ceil_div(self.reservation_slots(req), self.block_size) * self.block_size

    def admit(self, req: Request, num_new_tokens: int, num_hit_tokens: int) -> AdmissionBlock | None:
        n = _ceil_div(self.reservation_slots(req), self.block_size)
        for i, length in enumerate(self._run_lens):
            if length >= n:
                start = self._run_starts[i]
                if length == n:
                    del self._run_starts[i]
                    del self._run_lens[i]
                else:
                    self._run_starts[i] = start + n
                    self._run_lens[i] = length - n
                break
        else:
            bs = self.block_size
            largest = max(self._run_lens, default=0)
            reason = "external_fragmentation" if self._free_blocks >= n else "memory"
            return AdmissionBlock(reason, n * bs, self._free_blocks * bs, len(self._run_lens), largest * bs)
        self._free_blocks -= n
        rid = req.request_id
        self.runs[rid] = (start, n)
        capacity = n * self.block_size
        self._writable[rid] = capacity
        self._set_excess(req, capacity)
        return None

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """A reservation never grows: the request fits in its run or the pool is out of memory for it."""
        return self.can_append(req, num_new_tokens)

    def free(self, req: Request) -> None:
        rid = req.request_id
        run = self.runs.pop(rid, None)
        if run is None:
            return
        self._writable.pop(rid, None)
        self._drop_excess(req)
        start, n = run
        self._free_blocks += n
        starts, lens = self._run_starts, self._run_lens
        i = bisect.bisect_left(starts, start)
        # Coalesce with the hole after, then with the hole before.
        if i < len(starts) and starts[i] == start + n:
            n += lens[i]
            del starts[i]
            del lens[i]
        if i > 0 and starts[i - 1] + lens[i - 1] == start:
            lens[i - 1] += n
        else:
            starts.insert(i, start)
            lens.insert(i, n)

    def block_table(self, req: Request) -> list[int]:
        start, n = self.runs[req.request_id]
        return list(range(start, start + n))


def make_allocator(
    policy: str,
    num_blocks: int,
    block_size: int,
    *,
    enable_prefix_caching: bool = True,
    round_pow2: bool = True,
) -> KVAllocator:
    """Build the allocator for a policy name; the one place that maps names to classes."""
    if policy == "paged":
        return PagedAllocator(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    if policy == "contiguous":
        return ContiguousAllocator(num_blocks, block_size, round_pow2=round_pow2)
    if policy == "oracle":
        return ContiguousAllocator(num_blocks, block_size, round_pow2=round_pow2, oracle=True)
    raise ValueError(f"unknown allocation policy {policy!r} (choose from {', '.join(POLICIES)})")
