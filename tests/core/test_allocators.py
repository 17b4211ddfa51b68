"""Allocation policies: prefix caching and copy-on-write (paged), first-fit runs (contiguous, oracle)."""

from __future__ import annotations

import pytest

from kvtune.core import (
    ContiguousAllocator,
    PagedAllocator,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerStep,
    make_allocator,
)
from kvtune.core.prefix_hash import ROOT_HASH, salted_root
from tests.core.stub import prompt, run_step

# --- paged: prefix caching through the scheduler -------------------------------------------------------


def paged_scheduler(num_blocks: int = 16, block_size: int = 16, caching: bool = True) -> Scheduler:
    return Scheduler(PagedAllocator(num_blocks, block_size, enable_prefix_caching=caching))


def one_after_the_other(sched: Scheduler, first: Request, second: Request) -> SchedulerStep:
    """`first` runs a step alone, then `second` arrives: the step that admits it, for what it found cached."""
    sched.add_request(first)
    run_step(sched)
    sched.add_request(second)
    return run_step(sched)


def test_shared_40_token_prefix_at_block_size_16_shares_two_full_blocks() -> None:
    sched = paged_scheduler()
    alloc = sched.allocator
    assert isinstance(alloc, PagedAllocator)
    prefix = prompt(40, start=1000)
    first = Request("a", prefix + prompt(8, start=1), max_tokens=10)
    second = Request("b", prefix + prompt(8, start=500), max_tokens=10)
    step = one_after_the_other(sched, first, second)
    assert second in step.admitted
    assert second.num_cached_tokens == 32
    assert alloc.block_table(second)[:2] == alloc.block_table(first)[:2]
    assert alloc.block_table(second)[2] != alloc.block_table(first)[2]
    assert [alloc.pool.ref_cnt[b] for b in alloc.block_table(first)[:2]] == [2, 2]
    # Only the uncached tail is computed this step.
    assert step.num_tokens[step.requests.index(second)] == 48 - 32


def test_shared_prefix_shorter_than_a_block_shares_nothing() -> None:
    sched = paged_scheduler()
    prefix = prompt(12, start=1000)
    first = Request("a", prefix + prompt(20, start=1), max_tokens=10)
    second = Request("b", prefix + prompt(20, start=500), max_tokens=10)
    one_after_the_other(sched, first, second)
    assert second.num_cached_tokens == 0


def test_prompts_differing_in_their_first_token_share_nothing() -> None:
    sched = paged_scheduler()
    body = prompt(47, start=1000)
    first = Request("a", [1, *body], max_tokens=10)  # a timestamp at the front
    second = Request("b", [2, *body], max_tokens=10)
    one_after_the_other(sched, first, second)
    assert second.num_cached_tokens == 0


@pytest.mark.parametrize(("prompt_len", "expected_hit"), [(16, 0), (32, 16), (40, 32), (48, 32)])
def test_an_entirely_cached_prompt_still_computes_at_least_one_token(
    prompt_len: int, expected_hit: int
) -> None:
    sched = paged_scheduler()
    tokens = prompt(prompt_len, start=1000)
    again = Request("b", list(tokens), max_tokens=10)
    step = one_after_the_other(sched, Request("a", tokens, max_tokens=10), again)
    assert again.num_cached_tokens == expected_hit
    assert step.num_tokens[step.requests.index(again)] == prompt_len - expected_hit >= 1


def test_blocks_of_a_finished_request_stay_cached_for_the_next_one() -> None:
    sched = paged_scheduler()
    tokens = prompt(40, start=1000)
    done = Request("a", tokens, max_tokens=1)
    sched.add_request(done)
    run_step(sched)
    assert done.status is RequestStatus.FINISHED
    alloc = sched.allocator
    assert isinstance(alloc, PagedAllocator)
    assert alloc.pool.num_free_blocks == alloc.num_blocks
    later = Request("b", list(tokens), max_tokens=1)
    sched.add_request(later)
    run_step(sched)
    assert later.num_cached_tokens == 32


def test_prefix_caching_disabled_shares_nothing() -> None:
    sched = paged_scheduler(caching=False)
    tokens = prompt(48, start=1000)
    again = Request("b", list(tokens), max_tokens=10)
    one_after_the_other(sched, Request("a", tokens, max_tokens=10), again)
    assert again.num_cached_tokens == 0


def _hit_after(first_salt: str | None, second_salt: str | None, prompt_len: int = 48) -> int:
    """Tokens the second of two identical prompts finds cached, under the given cache salts."""
    sched = paged_scheduler()
    tokens = prompt(prompt_len, start=1000)
    again = Request("b", list(tokens), max_tokens=1, cache_salt=second_salt)
    one_after_the_other(sched, Request("a", tokens, max_tokens=1, cache_salt=first_salt), again)
    return again.num_cached_tokens


def test_identical_prompts_under_different_cache_salts_share_no_block() -> None:
    assert _hit_after("tenant-a", "tenant-b") == 0
    assert _hit_after(None, "tenant-b") == 0
    assert _hit_after("tenant-a", None) == 0


def test_one_cache_salt_shares_blocks_as_an_unsalted_prompt_does() -> None:
    assert _hit_after("tenant-a", "tenant-a") == _hit_after(None, None) == 32


def test_a_salted_prompt_publishes_its_output_blocks_under_its_salt() -> None:
    """A prompt under one block has no prompt hashes: its first full block (prompt + output) chains from
    the salted root too, so an unsalted prompt with the same tokens cannot hit it."""
    sched = paged_scheduler()
    first = Request("a", prompt(8, start=1000), max_tokens=12, cache_salt="s")
    sched.add_request(first)
    while first.status is not RequestStatus.FINISHED:
        run_step(sched)
    written = first.all_token_ids()[:16]
    for salt, expected in ((None, 0), ("s", 16)):
        probe = Request(f"probe-{salt}", [*written, 7], max_tokens=1, cache_salt=salt)
        sched.add_request(probe)
        run_step(sched)
        assert probe.num_cached_tokens == expected


def test_salted_roots_are_stable_and_distinct() -> None:
    assert salted_root(None) == ROOT_HASH
    assert salted_root("x") == salted_root("x") != salted_root("y")
    assert ROOT_HASH not in {salted_root("x"), salted_root("")}


def test_paged_admission_takes_only_the_prompt_blocks() -> None:
    sched = paged_scheduler(num_blocks=8, block_size=16)
    req = Request("a", prompt(20), max_tokens=100)
    sched.add_request(req)
    run_step(sched)
    assert sched.allocator.capacity["a"] == 32


# --- paged: copy-on-write after a fork -----------------------------------------------------------------


def running_parent_with_partial_last_block() -> tuple[Scheduler, PagedAllocator, Request]:
    """A parent whose 20-token prompt is computed at block size 16: block 1 is partial (4 of 16)."""
    alloc = PagedAllocator(num_blocks=8, block_size=16)
    sched = Scheduler(alloc)
    parent = Request("p", prompt(20), max_tokens=10)
    sched.add_request(parent)
    sched.schedule()
    assert parent.num_computed_tokens == 20
    return sched, alloc, parent


def test_fork_shares_every_block_of_the_parent() -> None:
    sched, alloc, parent = running_parent_with_partial_last_block()
    child = Request("c", list(parent.prompt_token_ids), max_tokens=10)
    assert sched.fork_request(parent, child)
    assert alloc.block_table(child) == alloc.block_table(parent)
    assert all(alloc.pool.ref_cnt[b] == 2 for b in alloc.block_table(parent))
    assert child.status is RequestStatus.RUNNING
    assert child.num_computed_tokens == parent.num_computed_tokens
    alloc.pool.check_invariants()


def test_allocator_grow_copies_a_shared_partial_block_before_writing() -> None:
    _, alloc, parent = running_parent_with_partial_last_block()
    child = Request("c", list(parent.prompt_token_ids), max_tokens=10)
    child.num_computed_tokens = parent.num_computed_tokens
    assert alloc.fork(parent, child)
    shared = alloc.block_table(parent)[-1]
    assert alloc.grow(child, 1)
    copy = alloc.block_table(child)[-1]
    assert copy != shared
    assert alloc.block_table(parent)[-1] == shared
    assert alloc.pool.ref_cnt[shared] == 1
    assert alloc.pool.ref_cnt[copy] == 1
    alloc.pool.check_invariants()
    assert alloc.take_copies() == [(shared, copy)]
    assert alloc.take_copies() == [], "a copy is handed out once"


def test_a_fork_makes_the_shared_partial_block_read_only_for_both() -> None:
    _, alloc, parent = running_parent_with_partial_last_block()
    child = Request("c", list(parent.prompt_token_ids), max_tokens=10)
    child.num_computed_tokens = parent.num_computed_tokens
    assert alloc.can_append(parent, 1)
    assert alloc.fork(parent, child)
    assert not alloc.can_append(parent, 1) and not alloc.can_append(child, 1)
    assert alloc.grow(child, 1)
    assert alloc.can_append(child, 1), "the child's copy is its own to write"
    shared = alloc.block_table(parent)[-1]
    assert alloc.grow(parent, 1) and alloc.block_table(parent)[-1] == shared
    assert alloc.take_copies() == [(shared, alloc.block_table(child)[-1])], "the sole holder needs no copy"
    assert alloc.can_append(parent, 1)


def test_child_writing_into_a_shared_partial_block_gets_its_own_copy() -> None:
    sched, alloc, parent = running_parent_with_partial_last_block()
    child = Request("c", list(parent.prompt_token_ids), max_tokens=10)
    assert sched.fork_request(parent, child)
    parent_table = list(alloc.block_table(parent))
    shared = parent_table[-1]
    sched.append_token(child, 7)  # only the child sampled: only the child writes this step
    step = sched.schedule()
    copy = alloc.block_table(child)[-1]
    assert copy != shared, "the child wrote token 20 into the block it shares with its parent"
    assert step.copies == [(shared, copy)]
    assert alloc.block_table(parent) == parent_table
    assert alloc.pool.ref_cnt[shared] == 1
    alloc.pool.check_invariants()


def test_parent_and_child_never_write_the_same_block_after_a_fork() -> None:
    sched, alloc, parent = running_parent_with_partial_last_block()
    child = Request("c", list(parent.prompt_token_ids), max_tokens=10)
    assert sched.fork_request(parent, child)
    shared = alloc.block_table(parent)[-1]
    sched.append_token(parent, 1)
    sched.append_token(child, 2)
    step = sched.schedule()
    assert alloc.block_table(parent)[-1] != alloc.block_table(child)[-1]
    assert len(step.copies) == 1
    src, dst = step.copies[0]
    assert src == shared
    assert {alloc.block_table(parent)[-1], alloc.block_table(child)[-1]} == {shared, dst}


def test_fork_after_the_parent_published_output_blocks_keeps_running() -> None:
    alloc = PagedAllocator(num_blocks=8, block_size=4)
    sched = Scheduler(alloc)
    parent = Request("p", prompt(4), max_tokens=20)
    sched.add_request(parent)
    while parent.num_computed_tokens < 9:  # two full blocks published, the second holds output tokens
        run_step(sched)
    child = Request("c", list(parent.prompt_token_ids), max_tokens=20)
    child.output_token_ids = list(parent.output_token_ids)  # same computed state as the parent
    assert sched.fork_request(parent, child)
    for _ in range(6):
        run_step(sched)
    assert child.num_computed_tokens >= 12
    alloc.pool.check_invariants()


def test_fork_of_a_waiting_request_is_refused() -> None:
    sched = paged_scheduler()
    waiting = Request("w", prompt(20), max_tokens=5)
    sched.add_request(waiting)
    assert not sched.fork_request(waiting, Request("c", prompt(20), max_tokens=5))
    assert "c" not in sched.allocator.capacity


def test_contiguous_policy_cannot_fork() -> None:
    sched = Scheduler(ContiguousAllocator(num_blocks=16, block_size=4))
    parent = Request("p", prompt(8), max_tokens=8)
    sched.add_request(parent)
    sched.schedule()
    child = Request("c", prompt(8), max_tokens=8)
    assert not sched.fork_request(parent, child)
    assert child.status is RequestStatus.WAITING
    assert sched.running == [parent]


# --- contiguous: first-fit runs, coalescing, sizing ------------------------------------------------------


def sized(rid: str, slots: int) -> Request:
    """A request whose unrounded contiguous reservation is exactly `slots` (prompt slots-1, max_tokens 1)."""
    return Request(rid, prompt(slots - 1), max_tokens=1)


def admit_all(alloc: ContiguousAllocator, *reqs: Request) -> None:
    for req in reqs:
        assert alloc.admit(req, req.num_prompt_tokens, 0) is None


def four_runs() -> tuple[ContiguousAllocator, list[Request]]:
    """12 blocks of 1 slot filled by runs a=[0,4) b=[4,8) c=[8,10) d=[10,12)."""
    alloc = ContiguousAllocator(num_blocks=12, block_size=1, round_pow2=False)
    reqs = [sized("a", 4), sized("b", 4), sized("c", 2), sized("d", 2)]
    admit_all(alloc, *reqs)
    return alloc, reqs


def test_runs_are_placed_first_fit_in_address_order() -> None:
    alloc, _ = four_runs()
    assert alloc.runs == {"a": (0, 4), "b": (4, 4), "c": (8, 2), "d": (10, 2)}
    assert alloc.free_runs == []


def test_first_fit_takes_the_lowest_hole_that_fits_not_the_tightest() -> None:
    alloc, (a, _, c, _) = four_runs()
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_runs == [(0, 4), (8, 2)]
    small = sized("e", 2)
    admit_all(alloc, small)
    assert alloc.runs["e"] == (0, 2)
    assert alloc.free_runs == [(2, 2), (8, 2)]
    assert alloc.block_table(small) == [0, 1]


def test_freeing_coalesces_with_the_hole_before() -> None:
    alloc, (a, b, _, _) = four_runs()
    alloc.free(a)
    alloc.free(b)
    assert alloc.free_runs == [(0, 8)]


def test_freeing_coalesces_with_the_hole_after() -> None:
    alloc, (a, b, _, _) = four_runs()
    alloc.free(b)
    alloc.free(a)
    assert alloc.free_runs == [(0, 8)]


def test_freeing_between_two_holes_merges_all_three() -> None:
    alloc, (a, b, c, _) = four_runs()
    alloc.free(a)
    alloc.free(c)
    alloc.free(b)
    assert alloc.free_runs == [(0, 10)]
    assert alloc.free_slots == 10


def test_freeing_everything_leaves_one_hole_covering_the_pool() -> None:
    alloc, reqs = four_runs()
    for req in (reqs[2], reqs[0], reqs[3], reqs[1]):
        alloc.free(req)
    assert alloc.free_runs == [(0, 12)]
    assert alloc.capacity == {}
    assert alloc.internal_slots == 0


def test_contiguous_reservation_rounds_prompt_plus_max_tokens_up_to_a_power_of_two() -> None:
    alloc = ContiguousAllocator(num_blocks=64, block_size=1, round_pow2=True)
    req = Request("a", prompt(10), max_tokens=20)
    assert alloc.reservation_slots(req) == 32
    admit_all(alloc, req)
    assert alloc.capacity["a"] == 32
    assert len(alloc.block_table(req)) == 32


def test_contiguous_reservation_without_rounding_is_prompt_plus_max_tokens_in_whole_blocks() -> None:
    alloc = ContiguousAllocator(num_blocks=64, block_size=4, round_pow2=False)
    req = Request("a", prompt(10), max_tokens=20)
    assert alloc.reservation_slots(req) == 30
    admit_all(alloc, req)
    assert alloc.capacity["a"] == 32
    assert alloc.runs["a"] == (0, 8)


def test_a_power_of_two_reservation_is_not_rounded_further() -> None:
    alloc = ContiguousAllocator(num_blocks=64, block_size=1, round_pow2=True)
    assert alloc.reservation_slots(Request("a", prompt(10), max_tokens=6)) == 16


def test_oracle_sizes_the_reservation_by_the_true_output_length() -> None:
    oracle = make_allocator("oracle", num_blocks=256, block_size=1)
    contiguous = make_allocator("contiguous", num_blocks=256, block_size=1)
    assert isinstance(oracle, ContiguousAllocator)
    assert isinstance(contiguous, ContiguousAllocator)
    req = Request("a", prompt(10), max_tokens=100, expected_output_len=6)
    assert oracle.reservation_slots(req) == 16
    assert contiguous.reservation_slots(req) == 128


def test_oracle_falls_back_to_max_tokens_and_caps_at_it() -> None:
    oracle = ContiguousAllocator(num_blocks=256, block_size=1, round_pow2=False, oracle=True)
    assert oracle.reservation_slots(Request("a", prompt(10), max_tokens=20)) == 30
    assert oracle.reservation_slots(Request("b", prompt(10), max_tokens=20, expected_output_len=50)) == 30


def test_admission_with_enough_free_slots_but_no_large_run_reports_external_fragmentation() -> None:
    alloc = ContiguousAllocator(num_blocks=12, block_size=2, round_pow2=False)
    a, b, c, d = sized("a", 8), sized("b", 8), sized("c", 4), sized("d", 4)
    admit_all(alloc, a, b, c, d)
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_runs == [(0, 4), (8, 2)]
    blocked = alloc.admit(sized("e", 10), 9, 0)
    assert blocked is not None
    assert blocked.reason == "external_fragmentation"
    assert blocked.slots_needed == 10
    assert blocked.slots_free == 12
    assert blocked.free_runs == 2
    assert blocked.largest_run == 8
    assert "e" not in alloc.capacity


def test_admission_with_too_few_free_slots_reports_memory() -> None:
    alloc = ContiguousAllocator(num_blocks=12, block_size=2, round_pow2=False)
    a, b, c, d = sized("a", 8), sized("b", 8), sized("c", 4), sized("d", 4)
    admit_all(alloc, a, b, c, d)
    alloc.free(a)
    alloc.free(c)
    blocked = alloc.admit(sized("e", 14), 13, 0)
    assert blocked is not None
    assert blocked.reason == "memory"
    assert blocked.slots_needed == 14
    assert blocked.slots_free == 12


def test_scheduler_reports_the_fragmentation_that_blocks_the_head_of_the_queue() -> None:
    alloc = ContiguousAllocator(num_blocks=12, block_size=1, round_pow2=False)
    sched = Scheduler(alloc)
    for req in (sized("a", 4), sized("b", 4), sized("c", 2), sized("d", 2)):
        sched.add_request(req)
    sched.schedule()
    sched.abort("a")
    sched.abort("c")
    sched.add_request(sized("e", 5))
    step = sched.schedule()
    assert step.admitted == []
    assert step.blocked is not None
    assert step.blocked.reason == "external_fragmentation"
    assert (step.blocked.slots_needed, step.blocked.slots_free) == (5, 6)
    assert (step.blocked.free_runs, step.blocked.largest_run) == (2, 4)


def test_contiguous_running_request_never_needs_to_grow_past_its_reservation() -> None:
    sched = Scheduler(ContiguousAllocator(num_blocks=8, block_size=4, round_pow2=False))
    req = Request("a", prompt(5), max_tokens=7)
    sched.add_request(req)
    while req.status is not RequestStatus.FINISHED:
        step = run_step(sched)
        assert step.preempted == []
    assert len(req.output_token_ids) == 7
    assert sched.num_preemptions == 0


def test_make_allocator_rejects_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown allocation policy"):
        make_allocator("buddy", num_blocks=8, block_size=4)
