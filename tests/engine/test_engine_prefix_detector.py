"""The prefix-defeat detector inside the engine: each prompt seen once, at its first admission, with the hit
the cache really gave it; `evicted` only for blocks that were cached and then evicted, never for blocks a
prompt of the same step was still computing; prompts compared only under the same key."""

from __future__ import annotations

import random
from pathlib import Path

from engine_loop_driver import assert_idle_and_all_free, greedy, make_engine, random_prompt, run_until_idle

from kvtune.core.prefix_defeats import PrefixDefeatDetector

BLOCK = 16


def detector_of(engine: object) -> PrefixDefeatDetector:
    detector = getattr(engine, "prefix_detector", None)
    assert isinstance(detector, PrefixDefeatDetector)
    return detector


def defeats(detector: PrefixDefeatDetector) -> dict[str, int]:
    return {reason: count for reason, (count, _) in detector.counts().items() if count}


def test_identical_prompts_admitted_in_one_step_are_not_called_evicted(tiny_dir: Path) -> None:
    """Both are admitted before either is computed, so the second hits nothing: a miss, not an eviction."""
    engine = make_engine(tiny_dir)
    prompt = random_prompt(random.Random(1), 6 * BLOCK)
    for rid in ("a", "b"):
        engine.add_request(rid, list(prompt), greedy(1))
    done = run_until_idle(engine)
    assert done["b"].num_cached_tokens == 0
    detector = detector_of(engine)
    assert detector.observed == 2
    assert defeats(detector) == {}
    assert_idle_and_all_free(engine)


def test_blocks_evicted_before_reuse_are_reported_as_evicted(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, kv_cache_tokens=16 * BLOCK)  # 16 blocks: one long prompt fills them
    rng = random.Random(2)
    prompt = random_prompt(rng, 4 * BLOCK)
    engine.add_request("first", list(prompt), greedy(1))
    run_until_idle(engine)
    engine.add_request("filler", random_prompt(rng, 15 * BLOCK), greedy(1))  # evicts the LRU blocks
    run_until_idle(engine)
    engine.add_request("again", list(prompt), greedy(1))
    hit = run_until_idle(engine)["again"].num_cached_tokens
    assert hit < 3 * BLOCK  # 3: a full hit still computes the last block
    detector = detector_of(engine)
    assert defeats(detector) == {"evicted": 1}
    (example,) = detector.report()["reasons"]["evicted"]["examples"]
    assert example["tokens_lost"] == 3 * BLOCK - hit
    assert example["since_last_use_s"] >= 0
    assert_idle_and_all_free(engine)


def test_a_preempted_request_is_observed_once(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, kv_cache_tokens=16 * BLOCK)
    rng = random.Random(3)
    for i in range(4):
        engine.add_request(f"r{i}", random_prompt(rng, 2 * BLOCK), greedy(5 * BLOCK, ignore_eos=True))
    run_until_idle(engine)
    assert engine.counters.num_preemptions > 0
    detector = detector_of(engine)
    assert detector.observed == 4
    assert defeats(detector) == {}  # a recompute hits its own blocks: nothing to say about the prompt
    assert_idle_and_all_free(engine)


def test_prompts_are_compared_only_under_the_same_key(tiny_dir: Path) -> None:
    """A varying head before a shared run is a finding within a tenant, not across tenants."""
    engine = make_engine(tiny_dir)
    rng = random.Random(4)
    shared = random_prompt(rng, 8 * BLOCK)
    for rid, key in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        engine.add_request(rid, random_prompt(rng, 10) + shared, greedy(1), prefix_key=key)
        run_until_idle(engine)
    detector = detector_of(engine)
    assert detector.report()["keys"] == 2
    assert defeats(detector) == {"varying_head": 1}  # "c" against "a"; "b" had nobody to match


def test_the_detector_is_off_with_prefix_detector_false(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, prefix_detector=False)
    assert engine.prefix_detector is None
    engine.add_request("a", random_prompt(random.Random(5), 40), greedy(2))
    run_until_idle(engine)
    assert_idle_and_all_free(engine)
