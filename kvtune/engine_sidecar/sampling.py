"""Sampling parameters of one request, validated, and the sampler that turns logits into next tokens.

Each request that asks for a seed gets its own torch.Generator, so its tokens do not depend on which other
requests share the batch: the same request with the same seed samples the same text under any load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtune.engine_sidecar.logprobs import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 16
# Below this temperature sampling is argmax (vLLM's _SAMPLING_EPS); dividing by it would overflow to inf/nan.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """OpenAI-style knobs. `temperature` below 1e-5 (0 included) is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a message a client can act on."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or at least 1, got {self.top_k}")
        if not 1 <= self.n <= 16:
            raise ValueError(f"n must be between 1 and 16, got {self.n}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids below {vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (with -inf) every token outside the top-k and outside the smallest set reaching top-p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = torch.cumsum(probs, dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


class Sampler:
    """Picks one token per row of logits, each row with its own parameters and generator."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        logits = logits.float()
        out = logits.argmax(dim=-1).tolist()
        for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
            if p.greedy:
                continue
            scaled = _filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(scaled, dim=-1)
            out[row] = int(torch.multinomial(probs, 1, generator=gen).item())
        return out
