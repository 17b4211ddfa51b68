"""`--seed` seeds torch's global generator once at boot, as vLLM's does: an engine started again with the
same seed and sent the same requests in the same order samples the same tokens, requests without a seed
of their own included."""

from __future__ import annotations

import random
from pathlib import Path

from engine_loop_driver import generate, make_engine, random_prompt

from kvtune.engine.model.sampling import SamplingParams

PROMPTS = {f"r{i}": random_prompt(random.Random(i), 12 + 5 * i) for i in range(3)}


def sampled(_: str) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True)


def tokens_after_boot(tiny_dir: Path, seed: int) -> dict[str, list[int]]:
    done = generate(make_engine(tiny_dir, seed=seed), PROMPTS, sampled)
    return {rid: done.tokens(rid) for rid in PROMPTS}


def test_a_restart_with_the_same_seed_samples_the_same_tokens(tiny_dir: Path) -> None:
    first = tokens_after_boot(tiny_dir, seed=11)
    assert tokens_after_boot(tiny_dir, seed=11) == first
    assert tokens_after_boot(tiny_dir, seed=12) != first
