"""One request's fault fails that request alone: the others finish with exactly the tokens of a run
without it, the failed one ends with finish reason "error" (not "abort"), and no block or prefix-cache
entry it held survives it. Faults are injected where the real step meets them: a row of the sampler, the
model's forward pass."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_loop_driver import (
    Collector,
    assert_idle_and_all_free,
    generate,
    greedy,
    make_engine,
    random_prompt,
    run_until_idle,
)

from kvtune.engine.loop.llm_engine import LLMEngine
from kvtune.engine.model.sampling import Sampler, SamplingParams

NEW_TOKENS = 20
rng = random.Random(5)
PROMPTS = {f"ok{i}": random_prompt(rng, 20 + 7 * i) for i in range(4)}
MARKED_SEED = 777  # the sampler hook below raises for rows sampled with this seed
FORWARD_MARKER = [7, 258, 7, 258, 7, 258]  # the model hook raises for a chunk holding this run


def healthy(_: str) -> SamplingParams:
    return greedy(NEW_TOKENS, ignore_eos=True)


def reference(tiny_dir: Path) -> Collector:
    return generate(make_engine(tiny_dir), PROMPTS, healthy)


def fail_rows_with_the_marked_seed(engine: LLMEngine, error: Exception) -> None:
    """From now on the engine's sampler raises `error` for a row sampled with MARKED_SEED."""
    original = engine.runner.sampler.sample_row

    def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        if params.seed == MARKED_SEED:
            raise error
        return original(logits, params, generator)

    setattr(engine.runner.sampler, "sample_row", sample_row)  # noqa: B010 (shadowing a method on purpose)


def fail_chunks_with_the_marker(engine: LLMEngine) -> list[int]:
    """From now on the model raises for any batch holding a chunk with FORWARD_MARKER in it (so a solo
    retry of any other chunk works). Returns the list of batch sizes at each raise."""
    model = engine.runner.model
    raised: list[int] = []

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any, cache: Any) -> torch.Tensor:
        starts = metadata.query_start_loc.tolist()
        for s in range(metadata.num_seqs):
            ids = input_ids[starts[s] : starts[s + 1]].tolist()
            if any(ids[i : i + len(FORWARD_MARKER)] == FORWARD_MARKER for i in range(len(ids))):
                raised.append(metadata.num_seqs)
                raise RuntimeError("injected forward fault")
        out: torch.Tensor = model(input_ids, positions, metadata, cache)
        return out

    setattr(engine.runner, "model", forward)  # noqa: B010
    return raised


def assert_healthy_match(done: Collector, expected: Collector) -> None:
    for rid in PROMPTS:
        assert done.tokens(rid) == expected.tokens(rid), rid
        assert done[rid].finish_reason == "length"


@pytest.mark.parametrize(
    ("error", "n"),
    [(RuntimeError("row fault"), 1), (ValueError("row fault"), 1), (RuntimeError("row fault"), 3)],
    ids=["runtime", "value", "n=3"],
)
def test_a_sampling_fault_fails_only_its_request(tiny_dir: Path, error: Exception, n: int) -> None:
    expected = reference(tiny_dir)
    engine = make_engine(tiny_dir)
    fail_rows_with_the_marked_seed(engine, error)
    bad = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=MARKED_SEED, n=n, ignore_eos=True)
    engine.add_request("bad", random_prompt(rng, 30), bad)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, healthy(rid))
    failures: list[Exception] = []
    done = Collector()

    def collect(outputs: list[Any]) -> None:
        failures.extend(out.error for out in outputs if out.error is not None)
        done.add(outputs)

    while engine.has_unfinished_requests():
        collect(engine.step())
    assert failures == [error]
    assert done["bad"].finish_reason == "error" and done["bad"].token_ids == []
    assert_healthy_match(done, expected)
    assert engine.counters.failures == {"sampling": 1}
    assert engine.counters.finished.get("error") == n and "abort" not in engine.counters.finished
    assert_idle_and_all_free(engine)


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])
def test_the_fuzzed_top_p_now_samples_the_best_token_beside_healthy_requests(
    tiny_dir: Path, top_p: float
) -> None:
    expected = reference(tiny_dir)
    engine = make_engine(tiny_dir)
    cold = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_p=top_p, ignore_eos=True)
    engine.add_request("cold", PROMPTS["ok0"], cold)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, healthy(rid))
    done = run_until_idle(engine)
    assert_healthy_match(done, expected)
    assert done.tokens("cold") == expected.tokens("ok0")  # top_p that small keeps only the best token
    assert engine.counters.failures == {}
    assert_idle_and_all_free(engine)


def test_a_forward_fault_fails_only_its_request_and_poisons_no_prefix(tiny_dir: Path) -> None:
    expected = reference(tiny_dir)
    prefix = random_prompt(rng, 32)  # two whole blocks, published to the prefix cache at scheduling
    clean = generate(make_engine(tiny_dir), {"after": [*prefix, 1, 2]}, healthy)

    engine = make_engine(tiny_dir)
    raised = fail_chunks_with_the_marker(engine)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, healthy(rid))
    done = Collector()
    run_steps(engine, 2, done.add)  # the healthy requests are decoding when the bad prompt arrives
    engine.add_request("bad", [*prefix, *FORWARD_MARKER], greedy(NEW_TOKENS))
    run_until_idle(engine, done)
    assert raised and max(raised) > 1, "the fault must hit a batch shared with healthy requests"
    assert done["bad"].finish_reason == "error"
    assert engine.counters.failures == {"forward": 1}
    assert_healthy_match(done, expected)
    assert_idle_and_all_free(engine)
    # The failed prompt's full blocks were published before its forward pass ran; they hold no KV.
    after = generate(engine, {"after": [*prefix, 1, 2]}, healthy)
    assert after["after"].num_cached_tokens == 0
    assert after.tokens("after") == clean.tokens("after")


def test_a_fault_outside_the_per_request_guards_fails_the_running_batch_not_the_queue(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_num_seqs=2)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, healthy(rid))
    run_steps(engine, 2)
    outputs = engine.fail_in_flight(ValueError("bookkeeping fault"))
    assert sorted(out.request_id for out in outputs) == ["ok0", "ok1"]
    assert all(out.finish_reason == "error" for out in outputs)
    # A ValueError out here is the engine's fault, not the input's: it must not become a 400.
    assert all(
        isinstance(out.error, RuntimeError) and "bookkeeping fault" in str(out.error) for out in outputs
    )
    assert engine.counters.failures == {"step": 2}
    done = run_until_idle(engine)
    assert sorted(rid for rid, _ in done.choices) == ["ok2", "ok3"]
    assert_idle_and_all_free(engine)


def run_steps(engine: LLMEngine, steps: int, sink: Callable[[list[Any]], None] | None = None) -> None:
    for _ in range(steps):
        outputs = engine.step()
        if sink is not None:
            sink(outputs)


def test_the_sampler_hook_goes_through_the_engines_own_sampler(tiny_dir: Path) -> None:
    """Guards the hook above: the engine samples through `Sampler.sample_row`, so the hook is honest."""
    engine = make_engine(tiny_dir)
    assert isinstance(engine.runner.sampler, Sampler)
    calls: list[int] = []
    original = engine.runner.sampler.sample_row

    def counting(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        calls.append(1)
        return original(logits, params, generator)

    setattr(engine.runner.sampler, "sample_row", counting)  # noqa: B010
    generate(engine, {"s": PROMPTS["ok0"]}, lambda _: SamplingParams(max_tokens=3, ignore_eos=True, seed=1))
    assert len(calls) == 3


def test_a_forward_fault_of_a_lone_request_fails_it_without_a_retry(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    raised = fail_chunks_with_the_marker(engine)
    engine.add_request("bad", [1, 2, *FORWARD_MARKER], greedy(NEW_TOKENS))
    done = run_until_idle(engine)
    assert raised == [1]  # one chunk: retrying it alone would only repeat the same pass
    assert done["bad"].finish_reason == "error" and engine.counters.failures == {"forward": 1}
    assert_idle_and_all_free(engine)
