"""Requests for the simulator: prompt and output lengths drawn from distributions, a saturated queue.

Prompt token ids are made unique per request (so nothing is shared by accident), except for an optional
shared system prompt at the front of every prompt, which is what prefix caching can share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtune.core import Request
from kvtune.sim.distributions import LengthDistribution

_UNIQUE_BASE = (
    1 << 24
)  # token ids of request r's own text start at (r + 1) << 24: never equal across requests


@dataclass(frozen=True)
class Workload:
    prompt_len: LengthDistribution
    output_len: LengthDistribution
    max_tokens: int
    shared_prefix: int = 0

    def requests(self, seed: int, batch: int = 256) -> RequestStream:
        return RequestStream(self, seed, batch)


class RequestStream:
    """An endless, reproducible stream of requests for one workload and seed."""

    def __init__(self, workload: Workload, seed: int, batch: int = 256) -> None:
        self.workload = workload
        self.rng = np.random.default_rng(seed)
        self.batch = batch
        self.count = 0
        self._prompts: list[int] = []
        self._outputs: list[int] = []
        self._shared = list(range(1, workload.shared_prefix + 1))

    def next(self) -> Request:
        if not self._prompts:
            self._prompts = self.workload.prompt_len.sample(self.rng, self.batch).tolist()[::-1]
            self._outputs = self.workload.output_len.sample(self.rng, self.batch).tolist()[::-1]
        prompt_len, output_len = self._prompts.pop(), self._outputs.pop()
        r = self.count
        self.count += 1
        shared = self._shared[:prompt_len]
        base = (r + 1) * _UNIQUE_BASE
        tokens = shared + list(range(base, base + prompt_len - len(shared)))
        max_tokens = self.workload.max_tokens
        return Request(
            str(r + 1), tokens, max_tokens, expected_output_len=min(output_len, max_tokens), arrival=r
        )
