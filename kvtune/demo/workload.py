"""The demo's workload: the seed's three problems at once, from the one load generator.

- clients declare `max_tokens` 2,048 but read about 256 tokens, then close the stream (the engine frees the
  request as an abort, as it would a client that stopped reading);
- every prompt opens with a shared system prompt of several blocks, with a timestamp at its head, which
  defeats the prefix cache; `move_timestamp()` is what the user does after reading the operator's flag: the
  timestamp goes after the shared prompt, and the shared blocks hash alike again;
- more concurrent clients than the KV pool holds at the engine's default `max_num_seqs`.
"""

from __future__ import annotations

import random
import threading
import time

from kvtune.demo.engine import MODEL_NAME
from kvtune.harness.load import LoadShape

DECLARED_MAX_TOKENS = 2048
ANSWER_TOKENS = (224, 288)  # about 256
SHARED_PROMPT_TOKENS = 320  # 20 16-token blocks: most of each prompt, stored once when it hashes alike
QUESTION_TOKENS = (8, 24)  # the unique part, short: it bounds the hit rate once the prefix hits
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S"


def shared_prompt(tokens: int = SHARED_PROMPT_TOKENS) -> list[int]:
    """The system prompt every client sends: fixed printable bytes (the tiny tokenizer's tokens)."""
    rng = random.Random(16)
    return [rng.randrange(32, 127) for _ in range(tokens)]


class PromptLayout:
    """Where the timestamp sits in each prompt's head; thread-safe, read by every client per request."""

    def __init__(self, shared: list[int]) -> None:
        self.shared = shared
        self._after = threading.Event()
        self._counter = 0

    @property
    def timestamp_after(self) -> bool:
        return self._after.is_set()

    def describe(self) -> str:
        return "timestamp after the shared prompt" if self.timestamp_after else "timestamp at the head"

    def move_timestamp(self) -> None:
        self._after.set()

    def _timestamp(self) -> list[int]:
        # the time to the millisecond plus a request counter: every prompt's head differs, as a real one does
        self._counter += 1
        stamp = f"[{time.strftime(TIMESTAMP_FORMAT)}.{int(time.time() * 1000) % 1000:03d} #{self._counter}] "
        return list(stamp.encode())

    def head(self) -> list[int]:
        stamp = self._timestamp()
        return self.shared + stamp if self.timestamp_after else stamp + self.shared


def load_shape(clients: int, layout: PromptLayout) -> LoadShape:
    return LoadShape(
        clients=clients,
        prompt_len=QUESTION_TOKENS,
        output_len=ANSWER_TOKENS,
        model=MODEL_NAME,
        declared_max_tokens=DECLARED_MAX_TOKENS,
        prompt_head=layout.head,
    )
