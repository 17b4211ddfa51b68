"""Feeds the prefix-defeat detector from forwarded requests, off the request's critical path.

The upstream request starts first; tokenizing (the chat template and the tokenizer, milliseconds for a long
prompt) and the detector's O(tokens) pass run afterwards on one worker thread, so they never add to time to
first token. One thread, as in the engine: parallel encodes would take the cores the event loop needs. When
the worker falls behind, new prompts are skipped (and counted) rather than queued without bound: the
detector samples the workload, it does not have to see every request.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtune.core.prefix_defeats import PrefixDefeatDetector
from kvtune.errors import KvtuneError
from kvtune.front.text.tokenizer import TextTokenizer
from kvtune.proxy.prompt_tokens import PromptTokens, PromptTooLongError

logger = logging.getLogger(__name__)

COMPLETIONS = "completions"
CHAT_COMPLETIONS = "chat_completions"
# Prompts waiting for the worker beyond which new ones are skipped: a burst of long prompts is absorbed,
# a sustained overload costs memory for no more than this many bodies.
DEFAULT_MAX_BACKLOG = 256


class PrefixWatch:
    """The detector, the tokenizer that feeds it, and the one worker thread both run on."""

    def __init__(
        self,
        detector: PrefixDefeatDetector,
        prompt_tokens: PromptTokens,
        report_text: bool = False,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
    ) -> None:
        self.detector = detector
        self.prompt_tokens = prompt_tokens
        self.report_text = report_text
        self.max_backlog = max_backlog
        self.skipped = 0  # prompts not observed because the worker was behind
        self.failed = 0  # bodies the tokenizer could not turn into ids (the upstream judges them)
        self._backlog = 0
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtune-prefix-watch")

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.prompt_tokens.tokenizer

    def submit(self, endpoint: str, body: dict[str, Any], key: str) -> bool:
        """Queue one forwarded body for the detector; False when it was skipped because the worker is behind."""
        with self._lock:
            if self._backlog >= self.max_backlog:
                self.skipped += 1
                return False
            self._backlog += 1
        self._worker.submit(self._observe, endpoint, body, key)
        return True

    def _observe(self, endpoint: str, body: dict[str, Any], key: str) -> None:
        try:
            salt = body.get("cache_salt")
            cache_salt = salt if isinstance(salt, str) and salt else None
            prompts = (
                self.prompt_tokens.chat(body)
                if endpoint == CHAT_COMPLETIONS
                else self.prompt_tokens.completion(body)
            )
            for ids in prompts:
                self.detector.observe(key, ids, cache_salt=cache_salt)
        except (KvtuneError, PromptTooLongError, ValueError, TypeError) as err:
            with self._lock:
                self.failed += 1
            logger.debug("prefix watch: a %s body was not observed: %s", endpoint, err)
        except Exception:  # a bug here must never take the worker down; the requests are already served
            with self._lock:
                self.failed += 1
            logger.exception("prefix watch: observing a %s body failed", endpoint)
        finally:
            with self._lock:
                self._backlog -= 1

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until every queued body has been observed (for tests and the benchmark's final report)."""
        self._worker.submit(lambda: None).result(timeout)

    def report(self) -> dict[str, Any]:
        """The detector's report; with the opt-in text flag, each example that kept its span's token ids
        also carries them decoded (prompt text is user data: only when the operator asked for it)."""
        report = self.detector.report()
        report["skipped_busy"] = self.skipped
        report["not_tokenized"] = self.failed
        if not self.report_text:
            return report
        for entry in report.get("reasons", {}).values():
            for example in entry.get("examples", []):
                span = example.get("span_token_ids")
                if span:
                    example["text"] = self.tokenizer.decode(span, skip_special_tokens=False)
        return report

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
