"""Scheduler: continuous batching, FCFS admission, the token budget, preemption by recompute."""

from __future__ import annotations

import pytest

from kvtune.core import (
    ContiguousAllocator,
    FinishReason,
    PagedAllocator,
    PrefixCacheStats,
    Request,
    RequestStatus,
    Sampled,
    Scheduler,
    SchedulerConfig,
)
from kvtune.core.scheduler import Preemption
from tests.core.stub import prompt, run_step


def paged(
    num_blocks: int, block_size: int, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(PagedAllocator(num_blocks, block_size), config)


# --- admission ---------------------------------------------------------------------------------------------


def test_max_num_seqs_caps_the_running_requests() -> None:
    sched = paged(64, 4, max_num_seqs=2)
    for i in range(5):
        sched.add_request(Request(str(i), prompt(4, start=10 * i), max_tokens=8))
    step = run_step(sched)
    assert [r.request_id for r in sched.running] == ["0", "1"]
    assert [r.request_id for r in step.admitted] == ["0", "1"]
    assert step.blocked is not None
    assert step.blocked.reason == "max_num_seqs"
    assert len(sched.waiting) == 3


def test_admission_is_first_come_first_served() -> None:
    sched = paged(64, 4)
    reqs = [Request(str(i), prompt(4, start=10 * i), max_tokens=8) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    step = sched.schedule()
    assert step.admitted == reqs
    assert sched.running == reqs


def test_head_of_the_queue_that_does_not_fit_blocks_smaller_requests_behind_it() -> None:
    sched = paged(4, 4)
    sched.add_request(Request("small0", prompt(4), max_tokens=8))
    sched.schedule()
    sched.add_request(Request("big", prompt(15, start=100), max_tokens=1))
    sched.add_request(Request("small1", prompt(4, start=200), max_tokens=8))
    step = sched.schedule()
    assert step.admitted == []
    assert step.blocked is not None
    assert step.blocked.reason == "memory"
    assert [r.request_id for r in sched.waiting] == ["big", "small1"]


def test_token_budget_chunks_a_long_prompt_over_several_steps() -> None:
    sched = paged(64, 4, max_num_batched_tokens=32)
    req = Request("long", prompt(100), max_tokens=4)
    sched.add_request(req)
    computed = []
    sampled = []
    for _ in range(4):
        step = sched.schedule()
        assert step.total_tokens <= 32
        computed.append(req.num_computed_tokens)
        sampled.append(req in step.sampling_requests())
        for ready in step.sampling_requests():
            sched.append_token(ready, 0)
    assert computed == [32, 64, 96, 100]
    assert sampled == [False, False, False, True]
    assert len(req.output_token_ids) == 1


def test_a_used_up_token_budget_blocks_admission() -> None:
    sched = paged(64, 4, max_num_batched_tokens=32)
    sched.add_request(Request("long", prompt(100), max_tokens=4))
    sched.add_request(Request("next", prompt(4, start=500), max_tokens=4))
    step = sched.schedule()
    assert [r.request_id for r in step.admitted] == ["long"]
    assert step.blocked is not None
    assert step.blocked.reason == "token_budget"


def test_running_requests_are_served_before_admissions_within_the_budget() -> None:
    sched = paged(64, 4, max_num_batched_tokens=10)
    first = Request("a", prompt(8), max_tokens=8)
    sched.add_request(first)
    run_step(sched)
    second = Request("b", prompt(20, start=100), max_tokens=8)
    sched.add_request(second)
    step = run_step(sched)
    assert step.requests == [first, second]
    assert step.num_tokens == [1, 9]


# --- add_request -----------------------------------------------------------------------------------------


def test_a_prompt_larger_than_the_whole_paged_pool_is_refused() -> None:
    sched = paged(4, 4)
    with pytest.raises(ValueError, match="whole pool"):
        sched.add_request(Request("huge", prompt(16), max_tokens=1))
    assert not sched.has_work
    sched.add_request(Request("fits", prompt(15), max_tokens=1))
    assert len(sched.waiting) == 1


def test_a_contiguous_reservation_larger_than_the_pool_is_refused_even_if_the_prompt_fits() -> None:
    sched = Scheduler(ContiguousAllocator(num_blocks=4, block_size=4, round_pow2=True))
    with pytest.raises(ValueError, match="whole pool"):
        sched.add_request(Request("a", prompt(8), max_tokens=16))
    sched.add_request(Request("b", prompt(8), max_tokens=8))
    assert len(sched.waiting) == 1


def test_a_paged_request_accepted_by_add_request_finishes_when_it_runs_alone() -> None:
    # 16 slots; prompt 8 + 20 output tokens needs 27 computed slots. Either refuse it up front or let it
    # finish: accepting it and then preempting it forever loses the request.
    sched = paged(4, 4)
    req = Request("r", prompt(8), max_tokens=20)
    try:
        sched.add_request(req)
    except ValueError:
        return
    for _ in range(200):
        if not sched.has_work:
            break
        run_step(sched)
    assert req.status is RequestStatus.FINISHED, (
        f"accepted request never finished: {sched.num_preemptions} self-preemptions"
    )


def test_duplicate_request_ids_are_refused() -> None:
    sched = paged(16, 4)
    sched.add_request(Request("a", prompt(4), max_tokens=4))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(Request("a", prompt(4), max_tokens=4))


# --- preemption ------------------------------------------------------------------------------------------


def three_single_block_requests() -> tuple[Scheduler, list[Request]]:
    """4 blocks of 4 slots: a, b, c each hold one full prompt block and have sampled one token.

    Each fits alone (4 + 6 - 1 slots computed at most), so all can finish despite preemption.
    """
    sched = paged(4, 4)
    reqs = [Request(rid, prompt(4, start=10 * i), max_tokens=6) for i, rid in enumerate("abc")]
    for req in reqs:
        sched.add_request(req)
    run_step(sched)
    assert all(len(r.output_token_ids) == 1 for r in reqs)
    return sched, reqs


def test_preemption_evicts_the_most_recently_admitted_running_request() -> None:
    sched, (a, b, c) = three_single_block_requests()
    later = Request("d", prompt(4, start=900), max_tokens=4)
    sched.add_request(later)
    step = run_step(sched)
    assert step.preempted == [c]
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c, later]
    assert c.status is RequestStatus.WAITING
    assert c.num_computed_tokens == 0
    assert c.num_preemptions == 1
    assert "c" not in sched.allocator.capacity


def test_preemption_in_discard_mode_clears_the_output_and_counts_it() -> None:
    sched, (_, b, c) = three_single_block_requests()
    run_step(sched)
    assert c.output_token_ids == []
    assert c.num_tokens == c.num_prompt_tokens
    assert sched.num_preemptions == 1
    assert sched.discarded_tokens == 1
    assert list(sched.preemption_log) == [
        Preemption(step=1, needed_by=b.request_id, victim="c", discarded_tokens=1)
    ]


def test_preemption_without_discard_keeps_the_output_and_discards_nothing() -> None:
    sched = Scheduler(PagedAllocator(4, 4), SchedulerConfig(discard_output_on_preempt=False))
    reqs = [Request(rid, prompt(4, start=10 * i), max_tokens=6) for i, rid in enumerate("abc")]
    for req in reqs:
        sched.add_request(req)
    run_step(sched)
    step = run_step(sched)
    victim = reqs[2]
    assert step.preempted == [victim]
    assert len(victim.output_token_ids) == 1
    assert victim.num_computed_tokens == 0
    assert sched.discarded_tokens == 0
    assert sched.preemption_log[-1].discarded_tokens == 0


def two_running_requests_about_to_run_dry() -> tuple[Scheduler, Request, Request]:
    """a (1 block) and b (2 blocks) fill 3 of 4 blocks; at the next step a takes the last block and b,
    the newest, must evict itself."""
    sched = paged(4, 4)
    a = Request("a", prompt(4), max_tokens=8)
    b = Request("b", prompt(8, start=100), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    return sched, a, b


def test_a_step_that_preempted_admits_nobody() -> None:
    # b's 2 freed blocks would let it back in at once, but not in the same step.
    sched, a, b = two_running_requests_about_to_run_dry()
    step = run_step(sched)
    assert step.preempted == [b]
    assert step.admitted == []
    assert list(sched.waiting) == [b]
    assert sched.running == [a]
    step = run_step(sched)
    assert step.admitted == [b]
    assert b.num_cached_tokens == 4, "the readmitted request should find its own prompt block cached"


def test_prefix_cache_counters_count_each_request_once_at_first_admission() -> None:
    # b's readmission after its preemption hits its own prompt block, which is no client's hit.
    sched, _, b = two_running_requests_about_to_run_dry()
    assert sched.prefix_cache == PrefixCacheStats(requests=2, queries=12, hits=0)
    run_step(sched)
    step = run_step(sched)
    assert step.admitted == [b] and b.num_cached_tokens == 4
    assert sched.prefix_cache == PrefixCacheStats(requests=2, queries=12, hits=0)
    c = Request("c", [*prompt(4), 7], max_tokens=1)
    sched.add_request(c)
    while c.status is not RequestStatus.RUNNING and sched.has_work:
        run_step(sched)
    assert c.num_cached_tokens == 4, "c shares a's whole first block"
    assert sched.prefix_cache == PrefixCacheStats(requests=3, queries=17, hits=4)


def test_a_preempted_request_recomputes_from_its_prompt_and_still_finishes() -> None:
    sched, reqs = three_single_block_requests()
    for _ in range(200):
        if not sched.has_work:
            break
        run_step(sched)
    assert sched.num_preemptions >= 1
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert all(len(r.output_token_ids) == 6 for r in reqs)


# --- abort -----------------------------------------------------------------------------------------------


def test_abort_of_a_waiting_request_removes_it_from_the_queue() -> None:
    sched = paged(16, 4)
    req = Request("a", prompt(4), max_tokens=4)
    sched.add_request(req)
    assert sched.abort("a") is req
    assert not sched.has_work
    assert req.status is RequestStatus.FINISHED
    assert req.finish_reason is FinishReason.ABORT
    assert sched.pop_finished() == [req]


def test_abort_of_a_running_request_frees_its_memory() -> None:
    alloc = PagedAllocator(16, 4, enable_prefix_caching=False)
    sched = Scheduler(alloc)
    req = Request("a", prompt(10), max_tokens=4)
    sched.add_request(req)
    sched.schedule()
    assert alloc.pool.num_used_blocks == 3
    sched.abort("a")
    assert sched.running == []
    assert alloc.pool.num_free_blocks == 16
    assert alloc.capacity == {}
    assert req.finish_reason is FinishReason.ABORT


def test_abort_of_a_running_contiguous_request_returns_its_run() -> None:
    alloc = ContiguousAllocator(num_blocks=16, block_size=4)
    sched = Scheduler(alloc)
    sched.add_request(Request("a", prompt(10), max_tokens=4))
    sched.schedule()
    assert alloc.free_runs == [(4, 12)]
    sched.abort("a")
    assert alloc.free_runs == [(0, 16)]
    assert alloc.capacity == {}


def test_abort_of_an_unknown_or_finished_request_returns_none() -> None:
    sched = paged(16, 4)
    assert sched.abort("nobody") is None
    sched.add_request(Request("a", prompt(4), max_tokens=4))
    sched.abort("a")
    assert sched.abort("a") is None


# --- append_token ----------------------------------------------------------------------------------------


def running_request(max_tokens: int, expected_output_len: int | None = None) -> tuple[Scheduler, Request]:
    alloc = PagedAllocator(16, 4)
    sched = Scheduler(alloc)
    req = Request("a", prompt(4), max_tokens=max_tokens, expected_output_len=expected_output_len)
    sched.add_request(req)
    sched.schedule()
    return sched, req


def test_append_token_finishes_on_max_tokens_with_reason_length() -> None:
    sched, req = running_request(max_tokens=2)
    assert sched.append_token(req, 1) is False
    assert sched.running == [req]
    assert sched.append_token(req, 2) is True
    assert req.finish_reason is FinishReason.LENGTH
    assert req.status is RequestStatus.FINISHED
    assert sched.running == []
    assert sched.allocator.capacity == {}


def test_append_token_finishes_on_eos_with_reason_stop() -> None:
    sched, req = running_request(max_tokens=10)
    assert sched.append_token(req, 1, eos=True) is True
    assert req.finish_reason is FinishReason.STOP
    assert req.output_token_ids == [1]
    assert sched.pop_finished() == [req]


def test_append_token_finishes_at_the_known_output_length() -> None:
    sched, req = running_request(max_tokens=10, expected_output_len=3)
    assert [sched.append_token(req, t) for t in range(3)] == [False, False, True]
    assert req.status is RequestStatus.FINISHED
    assert req.finish_reason is FinishReason.LENGTH
    assert sched.allocator.capacity == {}


def test_requests_with_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        Request("a", [], max_tokens=4)
    with pytest.raises(ValueError):
        Request("a", [1], max_tokens=0)


def test_config_refuses_non_positive_limits() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)


# --- update_from_output: one call applies a whole step -----------------------------------------------------


def test_update_from_output_appends_every_sampled_token_and_returns_what_it_ended() -> None:
    sched = paged(32, 4)
    short = Request("short", prompt(4), max_tokens=1)
    long_ = Request("long", prompt(4, start=10), max_tokens=5)
    eos = Request("eos", prompt(4, start=20), max_tokens=5)
    for req in (short, long_, eos):
        sched.add_request(req)
    step = sched.schedule()
    sampled = [Sampled(short, 7), Sampled(long_, 8), Sampled(eos, 9, stop=True)]
    assert sched.update_from_output(step, sampled) == [short, eos]
    assert (short.finish_reason, eos.finish_reason) == (FinishReason.LENGTH, FinishReason.STOP)
    assert long_.output_token_ids == [8] and sched.running == [long_]


def test_update_from_output_withdraws_a_faulted_chunk_from_the_prefix_cache() -> None:
    sched = paged(32, 4)
    bad = Request("bad", prompt(9), max_tokens=4)
    sched.add_request(bad)
    step = sched.schedule()  # publishes the two full prompt blocks as it schedules them
    sched.update_from_output(step, [], faulted=[(bad, step.num_tokens[0])])
    sched.abort("bad")
    again = Request("again", prompt(9), max_tokens=4)
    sched.add_request(again)
    sched.schedule()
    assert again.num_cached_tokens == 0, "blocks whose KV was never written must not be hits"


def family(sched: Scheduler, n: int, length: int = 6) -> tuple[Request, list[Request]]:
    parent = Request("p", prompt(length), max_tokens=4)
    children = [Request(f"p#{i}", prompt(length), max_tokens=4) for i in range(1, n)]
    sched.add_request(parent, children)
    return parent, children


def test_the_choices_fork_in_update_from_output_when_their_parent_first_samples() -> None:
    sched = paged(32, 4)
    parent, children = family(sched, 3)
    assert sched.num_waiting_choices == 2 and sched.running == []
    step = sched.schedule()
    assert sched.forks(step) == [(c, parent) for c in children]
    assert sched.running == [parent], "forks() only says; update_from_output forks"
    sampled = [Sampled(parent, 1), *(Sampled(c, 2 + i) for i, c in enumerate(children))]
    sched.update_from_output(step, sampled)
    assert sched.running == [parent, *children] and sched.num_waiting_choices == 0
    assert [c.output_token_ids for c in children] == [[2], [3]]
    assert all(c.num_computed_tokens == parent.num_computed_tokens for c in children)


def test_choices_without_a_running_slot_queue_instead_of_forking() -> None:
    sched = paged(32, 4, max_num_seqs=2)
    parent, children = family(sched, 3)
    step = sched.schedule()
    assert sched.forks(step) == [(children[0], parent)]
    sched.update_from_output(step, [Sampled(parent, 1), Sampled(children[0], 2)])
    assert sched.running == [parent, children[0]] and list(sched.waiting) == [children[1]]


def test_a_policy_that_cannot_share_queues_every_choice() -> None:
    sched = Scheduler(ContiguousAllocator(32, 4), SchedulerConfig())
    parent, children = family(sched, 3)
    step = sched.schedule()
    assert sched.forks(step) == []
    sched.update_from_output(step, [Sampled(parent, 1)])
    assert sched.running == [parent] and list(sched.waiting) == children


def test_choices_wait_while_their_parent_computes_its_prompt_and_never_fork_from_a_faulted_chunk() -> None:
    sched = paged(32, 4, max_num_batched_tokens=4)
    parent, children = family(sched, 2, length=6)
    step = sched.schedule()  # the first 4 of 6 prompt tokens: no sample yet
    assert sched.forks(step) == []
    sched.update_from_output(step, [])
    assert sched.num_waiting_choices == 1
    step = sched.schedule()
    faulted = [(parent, step.num_tokens[0])]
    assert sched.forks(step, faulted) == []
    sched.update_from_output(step, [], faulted)
    assert sched.num_waiting_choices == 1 and sched.release_choices("p") == children


def test_finish_gives_a_request_ended_on_its_length_the_stop_reason() -> None:
    sched, req = running_request(max_tokens=1)
    assert sched.append_token(req, 1)
    sched.finish(req, FinishReason.STOP)  # a stop string in the same last token
    assert req.finish_reason is FinishReason.STOP and sched.pop_finished() == [req]
