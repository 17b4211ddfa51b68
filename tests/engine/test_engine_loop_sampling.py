"""Sampling through the engine: n > 1 choices fork the prompt's blocks (copy-on-write on the shared partial
block), greedy choices agree, a seed fixes the tokens under any batch, and bad parameters are refused."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_loop_driver import (
    BLOCK_SIZE,
    Collector,
    assert_idle_and_all_free,
    generate,
    greedy,
    make_engine,
    random_prompt,
    run_until_idle,
)

from kvtune.core.allocators import PagedAllocator
from kvtune.engine.model.sampling import SamplingParams

NEW_TOKENS = 24
PROMPT = random_prompt(random.Random(21), 37)  # 37 = two full blocks and a partial one


def _sampled(seed: int | None, **extra: Any) -> SamplingParams:
    settings: dict[str, Any] = {
        "max_tokens": NEW_TOKENS,
        "temperature": 0.9,
        "top_p": 0.95,
        "ignore_eos": True,
    }
    settings.update(extra)
    return SamplingParams(seed=seed, **settings)


@pytest.mark.parametrize("prompt_len", [37, 32], ids=["partial-last-block", "whole-blocks"])
def test_n_choices_share_the_prompt_blocks_and_copy_the_partial_one_on_write(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, prompt_len: int
) -> None:
    n = 3
    prompt = random_prompt(random.Random(5), prompt_len)
    engine = make_engine(tiny_dir)
    alloc = engine.allocator
    assert isinstance(alloc, PagedAllocator)
    copies: list[tuple[int, int]] = []
    copy_blocks = engine.runner.copy_blocks

    def recording_copy(pairs: list[tuple[int, int]]) -> None:
        copies.extend(pairs)
        copy_blocks(pairs)

    monkeypatch.setattr(engine.runner, "copy_blocks", recording_copy)
    engine.add_request("fork", prompt, greedy(NEW_TOKENS, ignore_eos=True, n=n))
    done = Collector()
    done.add(engine.step())  # the whole prompt, then the first token of each choice
    prompt_blocks = -(-prompt_len // BLOCK_SIZE)
    tables = [list(alloc.blocks[rid]) for rid in ("fork", "fork#1", "fork#2")]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == prompt_blocks
    assert alloc.pool.num_used_blocks == prompt_blocks
    assert all(alloc.pool.ref_cnt[b] == n for b in tables[0])
    done.add(engine.step())  # every choice writes its first token's KV
    shared_full = prompt_len // BLOCK_SIZE
    for rid in ("fork", "fork#1", "fork#2"):
        assert alloc.blocks[rid][:shared_full] == tables[0][:shared_full]
    if prompt_len % BLOCK_SIZE:
        # The last sharer writes in place; the others copy the partial block first.
        assert len(copies) == n - 1 and all(src == tables[0][-1] for src, _ in copies)
        assert len({alloc.blocks[rid][shared_full] for rid in ("fork", "fork#1", "fork#2")}) == n
    else:
        assert copies == []
    run_until_idle(engine, done)
    single = generate(make_engine(tiny_dir), {"one": prompt}, lambda _: greedy(NEW_TOKENS, ignore_eos=True))
    assert len(single.tokens("one")) == NEW_TOKENS
    for index in range(n):
        assert done.tokens("fork", index) == single.tokens("one"), f"choice {index}"
        assert done.choices[("fork", index)].finish_reason == "length"
    assert_idle_and_all_free(engine)


def test_n_choices_without_room_to_fork_queue_and_still_agree(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=1)  # no running slot for a fork: choices wait their turn
    done = generate(engine, {"q": PROMPT}, lambda _: greedy(NEW_TOKENS, ignore_eos=True, n=3))
    assert done.tokens("q", 0) == done.tokens("q", 1) == done.tokens("q", 2)
    assert all(done.choices[("q", i)].num_cached_tokens == 32 for i in (1, 2))  # prompt blocks from cache
    assert_idle_and_all_free(engine)


def test_same_seed_same_tokens_under_any_batch_and_preemption(tiny_dir: Path) -> None:
    alone = generate(make_engine(tiny_dir), {"s": PROMPT}, lambda _: _sampled(7))
    again = generate(make_engine(tiny_dir), {"s": PROMPT}, lambda _: _sampled(7))
    assert alone.tokens("s") == again.tokens("s")
    greedy_tokens = generate(
        make_engine(tiny_dir), {"s": PROMPT}, lambda _: greedy(NEW_TOKENS, ignore_eos=True)
    )
    assert alone.tokens("s") != greedy_tokens.tokens("s"), "temperature 0.9 sampled the greedy tokens"

    # The same request joins a busy engine late, on a pool small enough to preempt.
    engine = make_engine(tiny_dir, kv_cache_tokens=12 * BLOCK_SIZE, max_num_batched_tokens=48)
    rng = random.Random(3)
    for i in range(5):
        params = _sampled(None, max_tokens=40) if i % 2 else greedy(40, ignore_eos=True)
        engine.add_request(f"other{i}", random_prompt(rng, rng.randrange(20, 60)), params)
    busy = Collector()
    for _ in range(3):
        busy.add(engine.step())
    engine.add_request("s", PROMPT, _sampled(7))
    run_until_idle(engine, busy)
    assert engine.counters.num_preemptions > 0
    assert busy.tokens("s") == alone.tokens("s")
    assert_idle_and_all_free(engine)


def test_different_seeds_sample_different_tokens(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    done = generate(engine, {"a": PROMPT, "b": PROMPT}, lambda rid: _sampled(1 if rid == "a" else 2))
    assert done.tokens("a") != done.tokens("b")
    both = generate(make_engine(tiny_dir), {"n": PROMPT}, lambda _: _sampled(1, n=2))
    assert both.tokens("n", 0) != both.tokens("n", 1), "choices of one seeded request must differ"
    assert both.tokens("n", 0) == done.tokens("a")  # choice 0 uses the request's seed itself


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_k=1, ignore_eos=True),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=5.0, top_k=1, ignore_eos=True, seed=3),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=1e-6, ignore_eos=True),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=2.0, top_p=1e-6, top_k=50, ignore_eos=True),
    ],
    ids=["top_k=1", "top_k=1-hot", "top_p-tiny", "top_p-tiny-top_k"],
)
def test_filters_that_keep_one_token_equal_greedy(tiny_dir: Path, params: SamplingParams) -> None:
    expected = generate(make_engine(tiny_dir), {"g": PROMPT}, lambda _: greedy(NEW_TOKENS, ignore_eos=True))
    done = generate(make_engine(tiny_dir), {"f": PROMPT}, lambda _: params)
    assert done.tokens("f") == expected.tokens("g")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be at least 1, got 0"),
        ("max_tokens", -5, "max_tokens must be at least 1, got -5"),
        ("temperature", -0.1, "temperature must be between 0 and 100, got -0.1"),
        ("temperature", 101.0, "temperature must be between 0 and 100"),
        ("temperature", float("nan"), "temperature must be between 0 and 100, got nan"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
        ("top_p", float("nan"), r"top_p must be in \(0, 1\]"),
        ("top_k", 0, r"top_k must be -1 \(off\) or at least 1, got 0"),
        ("top_k", -2, r"top_k must be -1 \(off\) or at least 1, got -2"),
        ("n", 0, "n must be between 1 and 16, got 0"),
        ("n", 17, "n must be between 1 and 16, got 17"),
        ("stop", ["x"] * 17, "at most 16 stop strings, got 17"),
        ("stop", ["ok", ""], "stop strings must not be empty"),
        ("stop_token_ids", [259], "stop_token_ids must be token ids below 259"),
        ("stop_token_ids", [-1], "stop_token_ids must be token ids below 259"),
        ("seed", 2**64, "seed must be a 64-bit signed integer"),
        ("seed", -(2**63) - 1, "seed must be a 64-bit signed integer"),
    ],
)
def test_validate_rejects_bad_values_with_a_clear_message(field: str, value: Any, message: str) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=message):
        params.validate(vocab_size=259)


def test_validate_accepts_the_edges() -> None:
    for params in [
        SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, n=16, seed=2**63 - 1),
        SamplingParams(temperature=100.0, top_p=1e-9, top_k=1, seed=-(2**63), stop=["s"] * 16),
        SamplingParams(stop_token_ids=[0, 258]),
    ]:
        params.validate(vocab_size=259)


def test_extreme_seeds_sample_without_error(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    done = generate(
        engine,
        {"hi": PROMPT, "lo": PROMPT},
        lambda rid: _sampled(2**63 - 1 if rid == "hi" else -(2**63), n=2),
    )
    assert all(len(done.tokens(rid, i)) == NEW_TOKENS for rid in ("hi", "lo") for i in (0, 1))
    assert_idle_and_all_free(engine)


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-44])
def test_a_vanishing_temperature_is_greedy_and_breaks_no_batch(tiny_dir: Path, temperature: float) -> None:
    expected = generate(make_engine(tiny_dir), {"g": PROMPT}, lambda _: greedy(NEW_TOKENS, ignore_eos=True))
    engine = make_engine(tiny_dir)
    engine.add_request("other", PROMPT, _sampled(5))
    engine.add_request("cold", PROMPT, _sampled(None, temperature=temperature, top_p=0.5))
    done = run_until_idle(engine)
    assert done.tokens("cold") == expected.tokens("g")
    assert len(done.tokens("other")) == NEW_TOKENS
    assert_idle_and_all_free(engine)
