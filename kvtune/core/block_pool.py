"""A pool of fixed-size KV blocks: reference counts, an LRU free queue and the prefix-cache table.

A block with reference count zero is free. If it still carries a hash it is *cached*: its tokens stay in
the table so a later request with the same prefix can take it back, until allocation needs the space
and evicts it, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtune.core.geometry import check_block_size


class BlockPool:
    """Blocks 0..num_blocks-1 with reference counts, a free queue and a hash -> block table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        check_block_size(block_size)
        if num_blocks <= 0:
            raise ValueError(f"the pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in eviction order (front = least recently freed). Values are unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        # Sum over blocks of (ref_cnt - 1) where ref_cnt >= 1: how many extra references sharing saves.
        self.num_shared_refs = 0
        self.num_evictions = 0

    # --- queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: int) -> int | None:
        """The block holding the tokens of `block_hash`, whether in use or free-but-cached."""
        return self._cached.get(block_hash)

    # --- allocation ----------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks off the front of the free queue, evicting their cached contents."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        free = self._free
        for _ in range(n):
            block, _ = free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                if self._cached.get(h) == block:
                    del self._cached[h]
                self.block_hash[block] = None
                self.num_evictions += 1
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, block: int) -> None:
        """Take one more reference to `block` (a prefix-cache hit or a fork)."""
        if self.ref_cnt[block] == 0:
            del self._free[block]
        else:
            self.num_shared_refs += 1
        self.ref_cnt[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference. At zero the block joins the back of the free queue, still cached if hashed."""
        rc = self.ref_cnt[block]
        if rc <= 0:
            raise ValueError(f"block {block} released with reference count {rc}")
        if rc == 1:
            self._free[block] = None
        else:
            self.num_shared_refs -= 1
        self.ref_cnt[block] = rc - 1

    def release_all(self, blocks: list[int]) -> None:
        """Release a sequence's blocks, tail first, so its last blocks are evicted before its prefix."""
        for block in reversed(blocks):
            self.release(block)

    def cache(self, block: int, block_hash: int) -> None:
        """Record that `block` holds the full block `block_hash`, so later requests can reuse it."""
        if self.block_hash[block] is not None:
            return
        self.block_hash[block] = block_hash
        self._cached.setdefault(block_hash, block)

    def uncache(self, block: int) -> None:
        """Forget what `block` holds (its contents were never written), so no lookup can return it."""
        block_hash = self.block_hash[block]
        if block_hash is None:
            return
        self.block_hash[block] = None
        if self._cached.get(block_hash) == block:
            del self._cached[block_hash]

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (used by tests; O(num_blocks))."""
        free = set(self._free)
        assert len(free) == len(self._free)
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b} has negative refcount"
            assert (self.ref_cnt[b] == 0) == (b in free), (
                f"block {b}: refcount {self.ref_cnt[b]} vs free list"
            )
        for h, b in self._cached.items():
            assert self.block_hash[b] == h
        shared = sum(max(0, rc - 1) for rc in self.ref_cnt)
        assert shared == self.num_shared_refs
