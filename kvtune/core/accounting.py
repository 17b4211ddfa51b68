"""The figures the seed reasons with, read off a scheduler and its allocator at one instant.

Terms: *reserved* = held for tokens the request will still write; *internal fragmentation* =
held past the request's final length, never reached; *external fragmentation* = free slots that the head
of the queue cannot use because no run of them is large enough; *effective* = slots holding a token ÷
slots held.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.core.allocators import KVAllocator
from kvtune.core.scheduler import Scheduler

BLOCK_TABLE_ENTRY_BYTES = 4  # vLLM keeps the table as int32

# Memory-map states of one block.
FREE, TOKENS, PARTIAL, RESERVED = 0, 1, 2, 3


@dataclass(frozen=True)
class Snapshot:
    resident_sequences: int
    tokens_held: int
    slots_held: int
    reserved_slots: int
    internal_slots: int
    external_slots: int
    free_slots: int
    block_table_entries: int

    @property
    def effective_utilization(self) -> float:
        return self.tokens_held / self.slots_held if self.slots_held else 1.0


def tokens_held(scheduler: Scheduler) -> int:
    """Token slots holding a token, counting a block shared by several sequences once."""
    total = 0
    for req in scheduler.running:
        total += req.num_computed_tokens
    return total - scheduler.allocator.shared_slots


def snapshot(scheduler: Scheduler, externally_blocked: bool = False) -> Snapshot:
    """Read the figures now. `externally_blocked`: the head of the queue waited on fragmentation this step."""
    alloc = scheduler.allocator
    held = alloc.slots_held
    tokens = tokens_held(scheduler)
    internal = min(alloc.internal_slots, held - tokens)
    free = alloc.free_slots
    return Snapshot(
        resident_sequences=len(scheduler.running),
        tokens_held=tokens,
        slots_held=held,
        reserved_slots=held - tokens - internal,
        internal_slots=internal,
        external_slots=free if externally_blocked else 0,
        free_slots=free,
        block_table_entries=alloc.num_table_entries,
    )


def block_table_bytes(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """vLLM's dense block table: int32 [max_num_seqs, ceil(max_model_len / block_size)]."""
    return max_num_seqs * (-(-max_model_len // block_size)) * BLOCK_TABLE_ENTRY_BYTES


def memory_map(scheduler: Scheduler) -> list[int]:
    """Per physical block: FREE, TOKENS (full), PARTIAL (some slots empty) or RESERVED (held, no token yet)."""
    alloc: KVAllocator = scheduler.allocator
    states = [FREE] * alloc.num_blocks
    bs = alloc.block_size
    for req in scheduler.running:
        table = alloc.block_table(req)
        filled = req.num_computed_tokens
        for i, block in enumerate(table):
            start = i * bs
            if filled >= start + bs:
                states[block] = TOKENS
            elif filled > start:
                states[block] = PARTIAL
            elif states[block] == FREE:
                states[block] = RESERVED
    return states
