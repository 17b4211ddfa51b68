"""What add_request refuses and what the engine keeps doing afterwards; aborts free every block; the live
levers (max_num_seqs; the max_tokens cap, which the HTTP layer applies) change admission without dropping or
evicting anyone."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

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

from kvtune.engine.loop.llm_engine import LLMEngine
from kvtune.engine.model.sampling import SamplingParams
from kvtune.errors import KvtuneError

MAX_MODEL_LEN = 256
GOOD_PROMPT = random_prompt(random.Random(8), 50)


@pytest.fixture(scope="module")
def good_tokens(tiny_dir: Path) -> list[int]:
    done = generate(make_engine(tiny_dir), {"good": GOOD_PROMPT}, lambda _: greedy(20, ignore_eos=True))
    return done.tokens("good")


def _assert_still_serves(engine: LLMEngine, good_tokens: list[int], request_id: str = "good") -> None:
    """No trace of the refused request, and a valid one runs to the usual tokens."""
    assert engine.num_waiting == 0 and engine.num_running == 0
    engine.add_request(request_id, list(GOOD_PROMPT), greedy(20, ignore_eos=True))
    done = run_until_idle(engine)
    assert done.tokens(request_id) == good_tokens
    assert_idle_and_all_free(engine)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        (
            [1] * MAX_MODEL_LEN,
            greedy(1),
            "the prompt has 256 tokens; this model's maximum context length is 256",
        ),
        ([1] * 300, greedy(1), "the prompt has 300 tokens"),
        ([1] * 200, greedy(57), "max_tokens 57 \\+ 200 prompt tokens exceeds the maximum context length 256"),
        ([], greedy(1), "the prompt is empty"),
        ([1, 2, 259], greedy(1), "prompt token ids must be below the vocabulary size 259"),
        ([1, -1], greedy(1), "prompt token ids must be below the vocabulary size 259"),
        ([1, 2], greedy(0), "max_tokens must be at least 1"),
        ([1, 2], SamplingParams(temperature=-1.0), "temperature must be between 0 and 100"),
        ([1, 2], greedy(4, stop_token_ids=[300]), "stop_token_ids must be token ids below 259"),
    ],
    ids=[
        "prompt-at-max-model-len",
        "prompt-over-max-model-len",
        "prompt-plus-max-tokens",
        "empty-prompt",
        "token-id-past-vocab",
        "negative-token-id",
        "zero-max-tokens",
        "negative-temperature",
        "stop-token-past-vocab",
    ],
)
def test_bad_requests_are_refused_with_value_error_and_the_engine_serves_on(
    tiny_dir: Path, good_tokens: list[int], prompt: list[int], params: SamplingParams, message: str
) -> None:
    engine = make_engine(tiny_dir, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    _assert_still_serves(engine, good_tokens, request_id="bad")  # the refused id is free to use


def test_a_duplicate_running_or_waiting_id_is_refused_and_the_original_runs_on(
    tiny_dir: Path, good_tokens: list[int]
) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=1)
    engine.add_request("dup", list(GOOD_PROMPT), greedy(20, ignore_eos=True))
    engine.add_request("queued", list(GOOD_PROMPT), greedy(20, ignore_eos=True))
    done = Collector()
    done.add(engine.step())
    for rid in ("dup", "queued"):  # running, and waiting behind max_num_seqs
        with pytest.raises(ValueError, match=f"request id '{rid}' is already running"):
            engine.add_request(rid, [1, 2, 3], greedy(5))
    run_until_idle(engine, done)
    assert done.tokens("dup") == good_tokens and done.tokens("queued") == good_tokens
    _assert_still_serves(engine, good_tokens, request_id="dup")  # finished ids can be reused


def test_an_id_that_clashes_with_a_choice_of_another_request_is_refused(
    tiny_dir: Path, good_tokens: list[int]
) -> None:
    engine = make_engine(tiny_dir)
    engine.add_request("x", list(GOOD_PROMPT), greedy(20, ignore_eos=True, n=2))  # its choice 1 is "x#1"
    engine.add_request("y#1", list(GOOD_PROMPT), greedy(20, ignore_eos=True))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("x#1", [1, 2, 3], greedy(5))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("y", [1, 2, 3], greedy(5, n=2))
    done = run_until_idle(engine)
    assert done.tokens("x", 0) == done.tokens("x", 1) == done.tokens("y#1") == good_tokens
    assert_idle_and_all_free(engine)


def test_a_request_the_pool_could_never_hold_is_refused_without_leaving_a_trace(
    tiny_dir: Path, good_tokens: list[int]
) -> None:
    # Contiguous reservations are prompt + max_tokens rounded up to a power of two: 100 + 600 -> 1024 > 768.
    engine = make_engine(tiny_dir, kv_cache_tokens=48 * BLOCK_SIZE, allocator="contiguous")
    with pytest.raises(ValueError, match="needs 1024 KV slots but the whole pool has 768"):
        engine.add_request("huge", [7] * 100, greedy(600, n=3))
    assert engine.num_waiting == 0, "the refused request's choices are still counted as waiting"
    _assert_still_serves(engine, good_tokens, request_id="huge")


def test_aborting_a_running_and_a_waiting_request_frees_every_block(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=2)
    rng = random.Random(2)
    prompts = {f"r{i}": random_prompt(rng, 40 + 10 * i) for i in range(4)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(30, ignore_eos=True))
    done = Collector()
    for _ in range(3):
        done.add(engine.step())
    assert engine.num_running == 2 and engine.num_waiting == 2
    streamed = {rid: len(done.tokens(rid)) for rid in ("r0", "r1")}
    engine.abort_request("r1")  # running
    engine.abort_request("r3")  # waiting
    engine.abort_request("never-added")  # a no-op
    assert "r1" not in engine.scheduler.requests and "r3" not in engine.scheduler.requests
    run_until_idle(engine, done)
    assert len(done.tokens("r1")) == streamed["r1"], "an aborted request streamed on"
    assert ("r3", 0) not in done.choices
    alone = generate(
        make_engine(tiny_dir), {k: prompts[k] for k in ("r0", "r2")}, lambda _: greedy(30, ignore_eos=True)
    )
    assert done.tokens("r0") == alone.tokens("r0") and done.tokens("r2") == alone.tokens("r2")
    assert engine.counters.finished == {"length": 2, "abort": 2}
    assert_idle_and_all_free(engine)


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3], ids=["choices-pending", "just-forked", "decoding"])
def test_aborting_a_forked_request_frees_its_shared_blocks(tiny_dir: Path, steps_before_abort: int) -> None:
    engine = make_engine(tiny_dir, kv_cache_tokens=64 * BLOCK_SIZE)
    engine.add_request("forked", random_prompt(random.Random(1), 45), greedy(30, ignore_eos=True, n=4))
    for _ in range(steps_before_abort):
        engine.step()
    engine.abort_request("forked")
    assert engine.allocator.slots_held == 0
    assert engine.counters.finished.get("abort", 0) == (1 if steps_before_abort == 0 else 4)
    assert_idle_and_all_free(engine)


def test_lowering_max_num_seqs_evicts_nobody_and_admission_waits(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=6)
    rng = random.Random(6)
    prompts = {f"r{i}": random_prompt(rng, rng.randrange(20, 60)) for i in range(10)}
    lengths = {rid: 8 + 4 * i for i, rid in enumerate(prompts)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy(lengths[rid], ignore_eos=True))
    done = Collector()
    done.add(engine.step())
    assert engine.num_running == 6
    engine.set_max_num_seqs(2)
    assert engine.max_num_seqs == 2
    running = [engine.num_running]
    run_until_idle(engine, done, on_step=lambda _: running.append(engine.num_running))
    # Nobody evicted: the running count only falls until it is under the new limit, then stays there.
    drained = next(i for i, n in enumerate(running) if n <= 2)
    assert all(a >= b for a, b in itertools.pairwise(running[: drained + 1]))
    assert max(running[drained:]) <= 2
    assert engine.counters.num_preemptions == 0
    assert {rid: len(done.tokens(rid)) for rid in prompts} == lengths
    assert all(done[rid].finish_reason == "length" for rid in prompts)
    with pytest.raises(ValueError, match="max_num_seqs must be positive, got 0"):
        engine.set_max_num_seqs(0)
    assert_idle_and_all_free(engine)


def test_the_engine_holds_the_live_cap_but_runs_max_tokens_as_given(tiny_dir: Path) -> None:
    """The HTTP layer applies the cap (one place decides, with its header and count); a direct engine user
    gets exactly the max_tokens it passes, whatever the live setting says."""
    engine = make_engine(tiny_dir, max_tokens_cap=5, cap_mode="reject")
    assert (engine.max_tokens_cap, engine.cap_mode) == (5, "reject")
    engine.add_request("over", list(GOOD_PROMPT), greedy(30, ignore_eos=True))
    done = run_until_idle(engine)
    assert len(done.tokens("over")) == 30
    engine.set_max_tokens_cap(None)
    engine.set_cap_mode("clamp")
    assert (engine.max_tokens_cap, engine.cap_mode) == (None, "clamp")
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"max_tokens_cap must be positive, got {bad}"):
            engine.set_max_tokens_cap(bad)
    with pytest.raises(ValueError, match="cap_mode must be one of clamp, reject, got 'drop'"):
        engine.set_cap_mode("drop")  # type: ignore[arg-type]
    assert (engine.max_tokens_cap, engine.cap_mode) == (None, "clamp")
    assert_idle_and_all_free(engine)


def test_an_unknown_cap_mode_is_refused_at_boot(tiny_dir: Path) -> None:
    with pytest.raises(KvtuneError, match="--cap-mode must be one of clamp, reject"):
        make_engine(tiny_dir, cap_mode="drop")


def test_an_empty_cache_salt_is_refused(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        engine.add_request("a", list(GOOD_PROMPT), greedy(3), cache_salt="")
    assert_idle_and_all_free(engine)
