"""Named scenarios. `seed` is the seed document's simulation, with what it leaves unstated inferred.

Stated by the seed: Qwen3-8B geometry (144 KiB per token), a 405,239-token pool (55.65 GiB), block size 16,
declared max_tokens 2,048, answers of about 256 tokens, 3,000 steps measured over the last 2,000, a
saturated queue. Inferred from its figures (docs/simulator.md, "How the seed scenario was calibrated"):

- prompts uniform on 1,300–6,800 tokens (mean 4,050): paged holds 405,239 / 95.4 ≈ 4,250 tokens per
  sequence, and contiguous with power-of-two rounding holds only 44 because about one prompt in nine
  rounds up to a 16,384-slot chunk while one in seven fits 4,096;
- output lengths uniform on 256 × (1 ± spread/100), spread 100 by default (0–512 tokens);
- no per-step token budget: everything that fits is admitted in the same step. The oracle's first
  fragmentation event names request 96, the first that did not fit the initial fill, and synchronised
  admission is what makes spread 0 preempt more than spread 100, as the seed reports.
"""

from __future__ import annotations

from dataclasses import replace

from kvtune.core.geometry import QWEN3_8B
from kvtune.errors import KvtuneError
from kvtune.sim.distributions import LengthDistribution
from kvtune.sim.simulator import SimConfig
from kvtune.sim.workload import Workload

SCENARIOS = ("seed",)

SEED_POOL_TOKENS = 405_239
SEED_PROMPT = LengthDistribution("uniform", 1300, 6800)
SEED_OUTPUT_MEAN = 256
SEED_SPREAD = 100.0
SEED_MAX_TOKENS = 2048
SEED_STEPS = 3000
SEED_WINDOW = 2000
SEED_MAX_MODEL_LEN = 40_960  # Qwen3-8B's, from the seed's boot line
SEED_TABLE_MAX_NUM_SEQS = 128  # the seed's block-table example


def seed_config(
    *,
    policy: str = "paged",
    max_tokens: int = SEED_MAX_TOKENS,
    block_size: int = 16,
    spread: float = SEED_SPREAD,
    round_pow2: bool = True,
    shared_prefix: int = 0,
    steps: int = SEED_STEPS,
    seed: int = 0,
    prompt: LengthDistribution = SEED_PROMPT,
    output: LengthDistribution | None = None,
    pool_tokens: int = SEED_POOL_TOKENS,
) -> SimConfig:
    """The seed's simulation with any of its sliders moved."""
    out = output or LengthDistribution("spread", SEED_OUTPUT_MEAN, spread)
    out.validate()
    workload = Workload(prompt_len=prompt, output_len=out, max_tokens=max_tokens, shared_prefix=shared_prefix)
    window = min(SEED_WINDOW, steps - steps // 3) if steps != SEED_STEPS else SEED_WINDOW
    return SimConfig(
        workload=workload,
        policy=policy,
        pool_tokens=pool_tokens,
        block_size=block_size,
        round_pow2=round_pow2,
        steps=steps,
        warmup=steps - window,
        seed=seed,
        max_num_seqs=1 << 20,
        max_num_batched_tokens=1 << 40,
        bytes_per_token=QWEN3_8B.bytes_per_token,
    )


def scenario_config(name: str, **overrides: object) -> SimConfig:
    if name != "seed":
        raise KvtuneError(f"unknown scenario {name!r} (choose from {', '.join(SCENARIOS)})")
    return seed_config(**overrides)  # type: ignore[arg-type]


def with_seed(cfg: SimConfig, seed: int) -> SimConfig:
    return replace(cfg, seed=seed)
