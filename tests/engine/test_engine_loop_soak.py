"""Nothing lost: random interleavings of valid and invalid adds, aborts and steps over a pool small enough to
preempt end with every accepted request finished or aborted, no output after an abort, greedy requests on
the tokens they get alone, and every block free."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_loop_driver import (
    BLOCK_SIZE,
    Collector,
    assert_idle_and_all_free,
    generate,
    make_engine,
    run_until_idle,
)

from kvtune.engine.model.sampling import SamplingParams

POOL_BLOCKS = 20
MAX_PROMPT = 90
MAX_NEW = 24


@dataclass(frozen=True)
class Add:
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    mode: str  # greedy | sampled | stop | bad-token | too-long | zero-max-tokens | duplicate


@dataclass(frozen=True)
class Abort:
    pick: int  # index into the ids added so far


@dataclass(frozen=True)
class Step:
    count: int


SHARED = tuple(range(40, 80))  # a system prompt some requests share: prefix-cache hits
VALID_MODES = ["greedy", "greedy", "greedy", "sampled", "stop"]
INVALID_MODES = ["bad-token", "too-long", "zero-max-tokens", "duplicate"]


def random_ops(seed: int, count: int) -> list[Add | Abort | Step]:
    """A bounded random interleaving: bursts of adds (one in five invalid), aborts, and steps."""
    rng = random.Random(seed)
    ops: list[Add | Abort | Step] = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.5:
            prompt = tuple(rng.randrange(256) for _ in range(rng.randint(1, MAX_PROMPT - len(SHARED))))
            if rng.random() < 0.3:
                prompt = SHARED + prompt
            mode = rng.choice(INVALID_MODES) if rng.random() < 0.2 else rng.choice(VALID_MODES)
            ops.append(Add(prompt, rng.randint(1, MAX_NEW), rng.choice([1, 1, 1, 2, 3]), mode))
        elif roll < 0.6:
            ops.append(Abort(rng.randrange(1000)))
        else:
            ops.append(Step(rng.randint(1, 4)))
    return ops


def _params(op: Add, index: int) -> SamplingParams:
    stop = ["a", "e "] if op.mode == "stop" else []
    temperature = 0.8 if op.mode == "sampled" else 0.0
    return SamplingParams(max_tokens=op.max_tokens, temperature=temperature, seed=index, n=op.n, stop=stop)


def _soak(tiny_dir: Path, allocator: str, ops: list[Add | Abort | Step]) -> tuple[int, int]:
    """Run one interleaving and check it; returns (preemptions, aborts of unfinished requests)."""
    engine = make_engine(tiny_dir, kv_cache_tokens=POOL_BLOCKS * BLOCK_SIZE, allocator=allocator,
                         max_num_seqs=6, max_num_batched_tokens=48)  # fmt: skip
    done = Collector()
    accepted: dict[str, tuple[Add, SamplingParams]] = {}
    aborted_at: dict[str, dict[int, int]] = {}  # id -> tokens each choice had streamed when it was aborted
    for op in ops:
        if isinstance(op, Step):
            for _ in range(op.count):
                done.add(engine.step())
        elif isinstance(op, Abort):
            if accepted:
                rid = list(accepted)[op.pick % len(accepted)]
                engine.abort_request(rid)
                streamed = {i: len(c.token_ids) for (r, i), c in done.choices.items() if r == rid}
                aborted_at.setdefault(rid, streamed)
        else:
            rid = f"r{len(accepted)}"
            params = _params(op, len(accepted))
            prompt = list(op.prompt)
            if op.mode == "bad-token":
                prompt[-1] = 300
            elif op.mode == "too-long":
                prompt = prompt * (engine.max_model_len // len(prompt) + 1)
            elif op.mode == "zero-max-tokens":
                params.max_tokens = 0
            elif op.mode == "duplicate":
                live = [r for r in accepted if r in engine.scheduler.requests]
                if not live:
                    continue
                rid = live[0]
            if op.mode in ("bad-token", "too-long", "zero-max-tokens", "duplicate"):
                waiting, running = engine.num_waiting, engine.num_running
                with pytest.raises(ValueError):
                    engine.add_request(rid, prompt, params)
                assert (engine.num_waiting, engine.num_running) == (waiting, running)
                continue
            engine.add_request(rid, prompt, params)
            accepted[rid] = (op, params)
    run_until_idle(engine, done)
    assert_idle_and_all_free(engine)

    finished = 0
    for rid, (op, params) in accepted.items():
        for index in range(op.n):
            choice = done.choices.get((rid, index))
            if rid in aborted_at and (choice is None or choice.num_finished == 0):
                # Aborted before it finished: it never streams again.
                assert (0 if choice is None else len(choice.token_ids)) == aborted_at[rid].get(index, 0)
                continue
            assert choice is not None and choice.num_finished == 1, f"{rid}#{index} was lost"
            assert choice.finish_reason in ("stop", "length")
            assert 1 <= len(choice.token_ids) <= params.max_tokens
            if choice.finish_reason == "length":
                assert len(choice.token_ids) == params.max_tokens
            finished += 1
    assert engine.counters.finished.get("stop", 0) + engine.counters.finished.get("length", 0) == finished

    # Greedy requests that ran to the end got the tokens they get alone on a roomy pool.
    plain = {
        rid: list(op.prompt)
        for rid, (op, _) in accepted.items()
        if op.mode == "greedy" and rid not in aborted_at
    }
    if plain:
        alone = generate(make_engine(tiny_dir), plain, lambda rid: accepted[rid][1])
        for rid in plain:
            for index in range(accepted[rid][0].n):
                assert done.tokens(rid, index) == alone.tokens(rid, 0), (
                    f"{rid}#{index} diverged under pressure"
                )
    return engine.counters.num_preemptions, engine.counters.finished.get("abort", 0)


@pytest.mark.parametrize(("allocator", "seeds"), [("paged", 12), ("contiguous", 4)])
def test_random_adds_aborts_and_steps_lose_nothing_and_free_every_block(
    tiny_dir: Path, allocator: str, seeds: int
) -> None:
    preempted = aborted = 0
    for seed in range(seeds):
        try:
            p, a = _soak(tiny_dir, allocator, random_ops(seed, 60))
        except AssertionError as err:
            raise AssertionError(f"{allocator} soak with seed {seed}: {err}") from err
        preempted, aborted = preempted + p, aborted + a
    assert aborted > 0, "no interleaving aborted an unfinished request"
    if allocator == "paged":
        assert preempted > 0, "no interleaving preempted"


def test_a_preempting_soak_really_preempts(tiny_dir: Path) -> None:
    """The pool above is small enough to preempt: a burst of long requests does."""
    engine = make_engine(
        tiny_dir, kv_cache_tokens=POOL_BLOCKS * BLOCK_SIZE, max_num_seqs=6, max_num_batched_tokens=48
    )
    prompts = {f"b{i}": [(7 * i + j) % 256 for j in range(MAX_PROMPT)] for i in range(6)}
    done = generate(
        engine, prompts, lambda _: SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    )
    assert engine.counters.num_preemptions > 0
    assert all(len(done.tokens(rid)) == MAX_NEW for rid in prompts)
    assert_idle_and_all_free(engine)
