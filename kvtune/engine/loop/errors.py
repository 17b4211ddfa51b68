"""How the engine loop says a request could not be served, and how a failure is counted.

The HTTP layer maps each error to its status (429, 503, 400 or 500); the metrics read the finish reason and
the stages a failure is labelled with.
"""

from __future__ import annotations

# vLLM's FinishReason.ERROR: the engine failed the request (counted apart from "abort", a client leaving).
ERROR_FINISH_REASON = "error"
# Where in a step a request failed (the label of kvtune:request_failures_total): its forward pass, its
# sampling, its output handling (stop checks, detokenizing), or elsewhere in the step.
FAILURE_STAGES = ("forward", "sampling", "output", "step")
# Seconds a refused client is told to wait (Retry-After): about one batch's worth of tokens on a busy engine.
RETRY_AFTER_SECONDS = 1


class EngineOverloadedError(Exception):
    """The waiting queue is full; the client should retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_SECONDS) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(Exception):
    """The engine thread is not running, so nothing can be served (HTTP 503)."""


class RequestFailedError(Exception):
    """The engine failed while running this request; it was dropped and the engine kept serving.

    `status` is 400 when the request's own input was at fault (a ValueError), else 500 (an internal fault):
    never 503, which clients read as "overloaded, retry".
    """

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status

    @classmethod
    def of(cls, error: Exception) -> RequestFailedError:
        if isinstance(error, ValueError):
            return cls(f"the engine could not run this request: {error}", 400)
        return cls(f"the engine failed while running this request: {error}", 500)
