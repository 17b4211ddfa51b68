"""The step's shape: the scheduler hears of a step once (`update_from_output`), and the output processor turns
the sampled tokens into text, stop strings and finish reasons after it. The processor is tested here without
a model, on core's scheduler and a UTF-8 byte decoder, the way the engine's step drives it."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from engine_loop_driver import assert_idle_and_all_free, greedy, make_engine, random_prompt, run_until_idle

from kvtune.core import FinishReason, PagedAllocator, Request, Scheduler, samples_now
from kvtune.engine.loop.output import ModelOutput, OutputProcessor, RequestOutput
from kvtune.engine.model.sampling import SamplingParams

EOS = 0


def test_update_from_output_runs_once_per_step_with_forks_stops_and_preemption(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(tiny_dir, kv_cache_tokens=12 * 16, max_num_batched_tokens=48)
    calls: list[int] = []
    update = engine.scheduler.update_from_output

    def counting(*args: Any, **kwargs: Any) -> list[Request]:
        calls.append(len(list(args[1])))
        return update(*args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "update_from_output", counting)
    rng = random.Random(9)
    engine.add_request("forks", random_prompt(rng, 37), greedy(30, ignore_eos=True, n=3))
    engine.add_request("stops", random_prompt(rng, 20), greedy(30, stop=["4"]))
    for i in range(4):
        engine.add_request(f"r{i}", random_prompt(rng, rng.randrange(20, 60)), greedy(40, ignore_eos=True))
    steps = 0

    def count(_: int) -> None:
        nonlocal steps
        steps += 1

    done = run_until_idle(engine, on_step=count)
    assert engine.counters.num_preemptions > 0, "the pool must be small enough to preempt"
    assert len(calls) == steps, "one update_from_output per step, not one per token"
    assert (
        sum(calls)
        == engine.counters.generation_tokens
        == sum(len(c.token_ids) for c in done.choices.values())
    )
    assert done.tokens("forks", 0) == done.tokens("forks", 1) == done.tokens("forks", 2)
    assert done["stops"].finish_reason == "stop" and "4" not in done["stops"].text  # a stop string
    assert_idle_and_all_free(engine)


# --- the output processor without a model ------------------------------------------------------------------


def decode_bytes(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


class Harness:
    """Core's scheduler and an OutputProcessor, stepped as LLMEngine.step does, with tokens given by hand."""

    def __init__(self) -> None:
        self.scheduler = Scheduler(PagedAllocator(64, 4))
        self.output = OutputProcessor(self.scheduler, decode_bytes, frozenset({EOS}))

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> Request:
        req = Request(rid, prompt, params.max_tokens)
        self.scheduler.add_request(req)
        self.output.add(rid, rid, 0, params, time.monotonic(), "key")
        return req

    def step(self, tokens: dict[str, int]) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        now = time.monotonic()
        self.output.scheduled(out, now)
        rows = [r for r in out.requests if samples_now(r)]
        model = ModelOutput(now, rows, [tokens[r.request_id] for r in rows], [None] * len(rows))
        sampled = self.output.sampled(model)
        self.scheduler.update_from_output(out, sampled, model.faulted)
        return self.output.process(model, sampled)

    def stream(self, rid: str, ids: Sequence[int]) -> list[RequestOutput]:
        return [one for token in ids for one in self.step({rid: token}) if one.request_id == rid]


def test_a_stop_string_spanning_tokens_ends_the_request_through_the_scheduler() -> None:
    h = Harness()
    req = h.add("s", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0.0, stop=["<end>"]))
    outs = h.stream("s", list(b"ok<end>"))
    # "<end>" is held back while it could still be a stop string, and cut once it is one.
    assert [o.new_text for o in outs] == ["", "", "", "", "o", "k", ""]
    assert [o.finished for o in outs] == [False] * 6 + [True]
    assert outs[-1].finish_reason == "stop" and req.finish_reason is FinishReason.STOP
    assert h.scheduler.running == [] and h.scheduler.allocator.slots_held == 0
    assert h.output.tracks == {} and h.output.counters.finished == {"stop": 1}


def test_a_stop_string_on_the_last_allowed_token_says_stop_not_length() -> None:
    h = Harness()
    h.add("s", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, stop=["yz"]))
    outs = h.stream("s", list(b"xyz"))
    assert "".join(o.new_text for o in outs) == "x" and outs[-1].finish_reason == "stop"
    assert h.output.counters.finished == {"stop": 1}


def test_text_is_detokenized_incrementally_and_waits_for_a_whole_character() -> None:
    h = Harness()
    h.add("t", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0))
    outs = h.stream("t", [ord("a"), *"€".encode(), ord("b"), ord("c")])
    assert [o.new_text for o in outs] == ["a", "", "", "€", "b", "c"]
    assert [o.new_token_ids for o in outs] == [[t] for t in [ord("a"), *"€".encode(), ord("b"), ord("c")]]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 6


def test_an_end_token_ends_the_text_and_carries_no_logprobs() -> None:
    h = Harness()
    h.add("e", [1, 2, 3], SamplingParams(max_tokens=9, temperature=0.0))
    outs = h.stream("e", [ord("h"), ord("i"), EOS])
    assert "".join(o.new_text for o in outs) == "hi"
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].logprobs is None


def test_a_row_that_failed_to_sample_fails_its_request_alone() -> None:
    h = Harness()
    h.add("ok", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    h.add("bad", [4, 5, 6], SamplingParams(max_tokens=2, temperature=0.0))
    out = h.scheduler.schedule()
    now = time.monotonic()
    h.output.scheduled(out, now)
    rows = list(out.requests)
    error = RuntimeError("row fault")
    model = ModelOutput(now, rows, [ord("k"), error], [None, None])
    sampled = h.output.sampled(model)
    assert [s.request.request_id for s in sampled] == ["ok"]
    h.scheduler.update_from_output(out, sampled, model.faulted)
    outputs = h.output.process(model, sampled)
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [
        ("ok", None, None),
        ("bad", "error", error),
    ]
    assert h.output.counters.failures == {"sampling": 1} and h.output.counters.finished == {"error": 1}
    assert [r.request_id for r in h.scheduler.running] == ["ok"]
