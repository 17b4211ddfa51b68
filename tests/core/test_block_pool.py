"""BlockPool: reference counts, the LRU free queue and the prefix-cache table."""

from __future__ import annotations

import pytest

from kvtune.core import BlockPool


def test_new_pool_has_every_block_free_with_zero_references() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    assert pool.num_free_blocks == 4
    assert pool.num_used_blocks == 0
    assert pool.ref_cnt == [0, 0, 0, 0]
    pool.check_invariants()


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (-1, 16), (4, 0), (4, -2)])
def test_pool_refuses_non_positive_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_allocate_hands_out_distinct_blocks_with_one_reference_each() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert all(pool.ref_cnt[b] == 1 for b in blocks)
    assert pool.num_used_blocks == 3
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_allocate_more_than_free_raises_and_leaves_the_pool_untouched() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    pool.allocate(3)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_touch_adds_a_reference_and_release_frees_only_at_zero() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    (b,) = pool.allocate(1)
    pool.touch(b)
    assert pool.ref_cnt[b] == 2
    assert pool.num_shared_refs == 1
    pool.release(b)
    assert pool.ref_cnt[b] == 1
    assert pool.num_shared_refs == 0
    assert pool.num_free_blocks == 1
    pool.release(b)
    assert pool.ref_cnt[b] == 0
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_release_of_a_free_block_raises_instead_of_going_negative() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    (b,) = pool.allocate(1)
    pool.release(b)
    with pytest.raises(ValueError):
        pool.release(b)
    assert pool.ref_cnt[b] == 0
    pool.check_invariants()


def test_freed_hashed_block_stays_cached_and_lookup_finds_it() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    (b,) = pool.allocate(1)
    pool.cache(b, block_hash=1234)
    pool.release(b)
    assert pool.num_free_blocks == 4
    assert pool.num_cached_blocks == 1
    assert pool.lookup(1234) == b


def test_touching_a_cached_free_block_takes_it_back_off_the_free_queue() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    (b,) = pool.allocate(1)
    pool.cache(b, block_hash=99)
    pool.release(b)
    pool.touch(b)
    assert pool.ref_cnt[b] == 1
    assert pool.num_free_blocks == 1
    # The remaining free block is the other one: the re-used block cannot be handed out again.
    assert pool.allocate(1) != [b]
    assert pool.lookup(99) == b
    pool.check_invariants()


def test_allocation_evicts_a_cached_block_and_forgets_its_hash() -> None:
    pool = BlockPool(num_blocks=1, block_size=4)
    (b,) = pool.allocate(1)
    pool.cache(b, block_hash=7)
    pool.release(b)
    assert pool.allocate(1) == [b]
    assert pool.lookup(7) is None
    assert pool.block_hash[b] is None
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_eviction_order_is_least_recently_freed_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(4)
    for b in blocks:
        pool.cache(b, block_hash=100 + b)
    for b in (2, 0, 3, 1):
        pool.release(b)
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [0]
    assert pool.lookup(102) is None
    assert pool.lookup(100) is None
    assert pool.lookup(103) == 3
    assert pool.lookup(101) == 1


def test_release_all_frees_the_tail_first_so_the_prefix_is_evicted_last() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    sequence = pool.allocate(3)
    for i, b in enumerate(sequence):
        pool.cache(b, block_hash=10 + i)
    pool.release_all(sequence)
    assert pool.allocate(1) == [sequence[2]]
    assert pool.allocate(1) == [sequence[1]]
    assert pool.lookup(10) == sequence[0]


def test_a_later_block_with_the_same_hash_does_not_steal_the_table_entry() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    first, second = pool.allocate(2)
    pool.cache(first, block_hash=5)
    pool.cache(second, block_hash=5)
    assert pool.lookup(5) == first
    # Evicting the duplicate must leave the original's entry in place.
    pool.release(second)
    pool.allocate(1)
    assert pool.lookup(5) == first
    pool.check_invariants()


def test_check_invariants_catches_a_refcount_that_disagrees_with_the_free_queue() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.ref_cnt[0] = 1  # corrupt: referenced, yet still on the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_check_invariants_catches_a_wrong_shared_reference_count() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    (b,) = pool.allocate(1)
    pool.touch(b)
    pool.num_shared_refs = 0
    with pytest.raises(AssertionError):
        pool.check_invariants()
