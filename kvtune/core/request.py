"""A request as the scheduler sees it: token ids, how many are in the KV cache, and why it stopped."""

from __future__ import annotations

import enum


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """vLLM's `finished_reason` label values."""

    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


class Request:
    """One generation request.

    `max_tokens` is what the client declared; `expected_output_len` is the true output length when it is
    known in advance (the simulator's workload, or the oracle allocator's magic), else None. `cache_salt`
    (vLLM's request field) starts the prompt's block-hash chain from a root of its own, so the request
    shares prefix-cache blocks only with requests of the same salt.
    """

    __slots__ = (
        "admitted_step",
        "arrival",
        "block_hashes",
        "cache_salt",
        "expected_output_len",
        "finish_reason",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output_token_ids",
        "prompt_token_ids",
        "request_id",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        expected_output_len: int | None = None,
        arrival: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if max_tokens <= 0:
            raise ValueError(f"request {request_id}: max_tokens must be positive, got {max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens
        self.expected_output_len = expected_output_len
        self.arrival = arrival
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.admitted_step = -1
        self.block_hashes: list[int] = []
        self.cache_salt = cache_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def final_length(self) -> int:
        """Tokens the request will hold when it finishes: known for the simulator, an upper bound otherwise."""
        out = self.expected_output_len if self.expected_output_len is not None else self.max_tokens
        return len(self.prompt_token_ids) + min(out, self.max_tokens)

    def token_at(self, index: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n_prompt else self.output_token_ids[index - n_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={len(self.output_token_ids)}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
