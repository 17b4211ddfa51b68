"""The greedy workload the engine-loop tests share (test_engine_loop_greedy.py, and the packed and widened
linear tests' bfloat16 runs): eight random prompts, each generating NEW_TOKENS greedy tokens past EOS, and a
pool too small to hold them all at once (SMALL_POOL_TOKENS), so that some are preempted."""

from __future__ import annotations

import random
from typing import Any

from engine_loop_driver import BLOCK_SIZE, greedy, random_prompt

NEW_TOKENS = 48
SMALL_POOL_TOKENS = 40 * BLOCK_SIZE  # eight requests of up to 12 blocks each cannot all be resident


def _workload() -> dict[str, list[int]]:
    rng = random.Random(4)
    return {f"r{i}": random_prompt(rng, rng.randrange(40, 140)) for i in range(8)}


WORKLOAD = _workload()


def workload_params(_: str) -> Any:
    """Each workload request's sampling: greedy, NEW_TOKENS tokens, EOS ignored."""
    return greedy(NEW_TOKENS, ignore_eos=True)
