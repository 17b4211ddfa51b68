"""The prefix watch never queues without bound: while its worker is behind, new prompts are skipped and
counted; a body the tokenizer cannot read is counted too, and the worker keeps going."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from kvtune.core.prefix_defeats import PrefixDefeatDetector
from kvtune.proxy.prefix_watch import COMPLETIONS, PrefixWatch
from kvtune.proxy.prompt_tokens import PromptTokens


class GatedTokens(PromptTokens):
    """The real tokenizer, held at a gate so a test decides when the worker may go on."""

    def __init__(self, tiny_dir: Path) -> None:
        base = PromptTokens.from_model_dir(tiny_dir)
        super().__init__(base.tokenizer, 4096)
        self.gate = threading.Event()

    def completion(self, body: dict[str, Any]) -> list[list[int]]:
        self.gate.wait(10)
        return super().completion(body)


def test_a_busy_worker_skips_prompts_instead_of_queueing_them(tiny_dir: Path) -> None:
    tokens = GatedTokens(tiny_dir)
    watch = PrefixWatch(PrefixDefeatDetector(16), tokens, max_backlog=2)
    try:
        accepted = [watch.submit(COMPLETIONS, {"prompt": f"prompt {i}"}, "tiny") for i in range(5)]
        assert accepted == [True, True, False, False, False]
        assert watch.skipped == 3
        tokens.gate.set()
        watch.drain()
        assert watch.detector.observed == 2
        assert watch.submit(COMPLETIONS, {"prompt": "after the burst"}, "tiny")
        watch.drain()
        assert watch.detector.observed == 3
        report = watch.report()
        assert (report["skipped_busy"], report["not_tokenized"]) == (3, 0)
    finally:
        watch.close()


def test_an_unreadable_body_is_counted_and_the_worker_goes_on(tiny_dir: Path) -> None:
    watch = PrefixWatch(PrefixDefeatDetector(16), PromptTokens.from_model_dir(tiny_dir))
    try:
        watch.submit(COMPLETIONS, {"prompt": "x" * 10_000_000}, "tiny")  # beyond the context: not tokenized
        watch.submit(COMPLETIONS, {"prompt": "fine"}, "tiny")
        watch.drain()
        assert watch.failed == 1
        assert watch.detector.observed == 1
    finally:
        watch.close()
