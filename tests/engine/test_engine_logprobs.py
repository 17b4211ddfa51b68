"""Logprobs of sampled tokens: the math on its own, and the engine's numbers against log_softmax of
transformers' logits for the same tokens (raw model distribution, before temperature, as vLLM reports)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_loop_driver import assert_idle_and_all_free, make_engine

from kvtune.engine.loop.llm_engine import LLMEngine, RequestOutput
from kvtune.engine.model.logprobs import LOGPROB_FLOOR, sampled_logprobs
from kvtune.engine.model.sampling import SamplingParams

PROMPT = [256, *b"The capital of France is"]
NEW_TOKENS = 12


def test_only_rows_that_ask_are_computed_and_tops_are_sorted() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    out = sampled_logprobs(logits, [1, 0, 2], [2, None, 0])
    assert out[1] is None
    first, third = out[0], out[2]
    assert first is not None and third is not None
    expected = torch.log_softmax(logits[0], dim=-1)
    assert first.token_id == 1 and first.logprob == pytest.approx(expected[1].item())
    assert [i for i, _ in first.top] == [3, 2]
    assert [v for _, v in first.top] == pytest.approx(expected[[3, 2]].tolist())
    assert third.top == () and third.logprob == pytest.approx(math.log(0.25))
    assert sampled_logprobs(logits, [0, 0, 0], [None, None, None]) == [None, None, None]


def test_impossible_tokens_get_a_finite_floor() -> None:
    """JSON has no -inf: a token the logits rule out reports vLLM's -9999.0 instead of breaking the body."""
    logits = torch.tensor([[0.0, float("-inf"), 0.0]])
    (out,) = sampled_logprobs(logits, [1], [3])
    assert out is not None and out.logprob == LOGPROB_FLOOR
    assert [v for _, v in out.top][-1] == LOGPROB_FLOOR


def _run(engine: LLMEngine, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request("r", list(PROMPT), params)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert_idle_and_all_free(engine)
    return outputs


def _reference_logprobs(hf_tiny: Any, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each position that predicted one of `tokens`."""
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([PROMPT + tokens])).logits[0]
    return torch.log_softmax(logits[len(PROMPT) - 1 : -1].float(), dim=-1)


def test_greedy_logprobs_equal_log_softmax_of_the_model(tiny_dir: Path, hf_tiny: Any) -> None:
    outputs = _run(
        make_engine(tiny_dir), SamplingParams(NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    )
    tokens = [t for out in outputs for t in out.new_token_ids]
    reference = _reference_logprobs(hf_tiny, tokens)
    assert len(outputs) == NEW_TOKENS
    for position, out in enumerate(outputs):
        got = out.logprobs
        assert got is not None and got.token_id == out.new_token_ids[0]
        assert got.logprob == pytest.approx(reference[position, got.token_id].item(), abs=1e-4)
        assert got.logprob == pytest.approx(reference[position].max().item(), abs=1e-4)  # greedy = the max
        assert len(got.top) == 5 and got.top[0] == (got.token_id, pytest.approx(got.logprob))
        top_values, top_ids = reference[position].topk(5)
        assert [i for i, _ in got.top] == top_ids.tolist()
        assert [v for _, v in got.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_sampled_logprobs_are_of_the_raw_distribution(tiny_dir: Path, hf_tiny: Any) -> None:
    """Temperature changes which token is drawn, not the reported logprob (vLLM's default)."""
    params = SamplingParams(NEW_TOKENS, temperature=1.7, seed=11, ignore_eos=True, logprobs=0)
    outputs = _run(make_engine(tiny_dir), params)
    tokens = [t for out in outputs for t in out.new_token_ids]
    reference = _reference_logprobs(hf_tiny, tokens)
    reported = [out.logprobs.logprob for out in outputs if out.logprobs is not None]
    assert reported == pytest.approx([reference[i, t].item() for i, t in enumerate(tokens)], abs=1e-4)
    assert any(reference[i, t] < reference[i].max() for i, t in enumerate(tokens)), "drew only argmaxes"
    assert all(out.logprobs is not None and out.logprobs.top == () for out in outputs)


def test_no_logprobs_unless_asked_and_none_for_the_hidden_end_token(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    plain = _run(engine, SamplingParams(NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert all(out.logprobs is None for out in plain)
    stop_at = plain[3].new_token_ids[0]  # the fourth greedy token ends the request as a stop token
    stopped = _run(engine, SamplingParams(NEW_TOKENS, temperature=0.0, stop_token_ids=[stop_at], logprobs=1))
    assert stopped[-1].finish_reason == "stop" and stopped[-1].logprobs is None
    assert all(out.logprobs is not None for out in stopped[:-1])


def test_greedy_tokens_do_not_change_when_logprobs_are_asked(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    without = _run(engine, SamplingParams(NEW_TOKENS, temperature=0.0, ignore_eos=True))
    with_logprobs = _run(engine, SamplingParams(NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20))
    assert [o.new_token_ids for o in without] == [o.new_token_ids for o in with_logprobs]
