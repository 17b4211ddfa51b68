"""Sampling parameters of one request, validated, and the sampler that turns logits into next tokens.

Each request that asks for a seed gets its own torch.Generator, so its tokens do not depend on which other
requests share the batch: the same request with the same seed samples the same text under any load.

The sampler is numerically safe for every parameter `validate` accepts and for any logits the model
produces (NaN and inf included): it works on float32 log-probabilities, where dividing by a temperature
can only push values towards -inf, and the row's best token always survives the top-k / top-p filters, so
the distribution handed to `torch.multinomial` is never empty and never NaN. One row's failure is reported
for that row only (see `Sampler.sample`), so one request can never take a batch down with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtune.engine.model.logprobs import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 16
# Below this temperature sampling is argmax (vLLM's _SAMPLING_EPS); dividing by it would overflow to inf/nan.
GREEDY_TEMPERATURE = 1e-5
# top_p is compared with float32 cumulative probabilities: below ~7e-46 it rounds to 0 and used to drop
# every token. Any top_p this small already keeps only the best token, so it is raised to this floor.
MIN_TOP_P = 1e-9
_FLOAT32_MAX = torch.finfo(torch.float32).max


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
        """Raise ValueError with a message a client can act on; normalise what is valid but extreme.

        Normalising: top_p below MIN_TOP_P becomes MIN_TOP_P and a top_k that covers the whole vocabulary
        becomes -1 (off); neither changes which tokens can be sampled.
        """
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
        self.top_p = max(self.top_p, MIN_TOP_P)
        if vocab_size is not None and self.top_k >= vocab_size:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _filter_top_k_top_p(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (with -inf) every token outside the top-k and outside the smallest set reaching top-p."""
    if top_k > 0 and top_k < logprobs.shape[-1]:
        kth = torch.topk(logprobs, top_k).values[-1]
        logprobs = logprobs.masked_fill(logprobs < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logprobs, order = torch.sort(logprobs, descending=True)
        probs = torch.softmax(sorted_logprobs, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = torch.cumsum(probs, dim=-1) - probs >= top_p
        drop[0] = False
        sorted_logprobs = sorted_logprobs.masked_fill(drop, float("-inf"))
        logprobs = torch.empty_like(logprobs).scatter_(0, order, sorted_logprobs)
    return logprobs


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits under `params`; any row of any values gives a valid token id.

    NaN logits count as impossible tokens and +inf as the largest float. The row is turned into
    log-probabilities (max 0) before the temperature divides it, so nothing overflows; the best token is
    put back after filtering, so at least one token always has probability 1 before normalisation.
    """
    row = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=_FLOAT32_MAX)
    best = int(row.argmax())
    if params.greedy or not torch.isfinite(row[best]):
        return best  # greedy, or every logit is -inf/NaN: no distribution to draw from
    scaled = torch.log_softmax(row, dim=-1) / params.temperature
    filtered = _filter_top_k_top_p(scaled, params.top_k, params.top_p)
    filtered[best] = scaled[best]
    probs = torch.softmax(filtered, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


class Sampler:
    """Picks one token per row of logits, each row with its own parameters and generator."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int | Exception]:
        """The token of each row, or the exception that row's sampling raised (for that row only).

        Greedy rows share one argmax over the batch; a sampled row runs alone with its own generator, so a
        failing row changes neither the tokens nor the generator state of any other row.
        """
        logits = logits.float()
        out: list[int | Exception] = list(logits.argmax(dim=-1).tolist())
        for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
            if p.greedy:
                continue
            try:
                out[row] = self.sample_row(logits[row], p, gen)
            except Exception as err:  # reported per row; the engine fails that request alone
                out[row] = err
        return out

    def sample_row(
        self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> int:
        return sample_row(logits, params, generator)
