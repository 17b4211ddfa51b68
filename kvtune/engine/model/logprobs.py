"""Log-probabilities of sampled tokens, for the requests that ask for them (OpenAI's `logprobs`).

They are the model's raw distribution, log_softmax of the logits before temperature, top-k or top-p, as
vLLM returns by default: a greedy token's logprob is the row's maximum whatever the sampling knobs. Only
the rows that asked are computed, so requests without logprobs cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
# JSON has no -inf; vLLM reports an impossible token as -9999.0 too.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's logprob and the `top` most likely tokens of the same distribution, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def sampled_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], top_counts: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Row i's TokenLogprobs for `token_ids[i]` with `top_counts[i]` alternatives; None where it is None."""
    rows = [i for i, count in enumerate(top_counts) if count is not None]
    result: list[TokenLogprobs | None] = [None] * len(top_counts)
    if not rows:
        return result
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=logprobs.device)
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    k = min(max(top_counts[i] or 0 for i in rows), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    values, ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        count = top_counts[i] or 0
        top = tuple(zip(ids[j][:count], values[j][:count], strict=True))
        result[i] = TokenLogprobs(token_id=int(token_ids[i]), logprob=chosen[j], top=top)
    return result
