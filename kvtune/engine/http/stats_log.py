"""The periodic stats log line, worded as vLLM's so that log parsers written for vLLM read kvtune too.

`Preemptions: N` (cumulative since boot) appears only once N > 0, so any occurrence is worth a look. The
prefix cache hit rate is cumulative as well, the same ratio as the two Prometheus counters.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvtune.engine.loop.thread import AsyncEngine, EngineStats

logger = logging.getLogger("kvtune.engine.stats")


class StatsLine:
    """Turns successive engine snapshots into log lines with throughput over the interval between them."""

    def __init__(self, stats: EngineStats, now: float) -> None:
        self._prompt = stats.counters.prompt_tokens
        self._generation = stats.counters.generation_tokens
        self._at = now

    def format(self, stats: EngineStats, now: float) -> tuple[str, bool]:
        """The line, and whether anything happened (an idle server logs at DEBUG, as vLLM's does)."""
        c = stats.counters
        elapsed = max(now - self._at, 1e-9)
        prompt_rate = (c.prompt_tokens - self._prompt) / elapsed
        generation_rate = (c.generation_tokens - self._generation) / elapsed
        busy = bool(prompt_rate or generation_rate or stats.num_running or stats.num_waiting)
        self._prompt, self._generation, self._at = c.prompt_tokens, c.generation_tokens, now
        hit_rate = 100.0 * c.prefix_cache_hits / c.prefix_cache_queries if c.prefix_cache_queries else 0.0
        line = (
            f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
            f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
        )
        if c.num_preemptions > 0:
            line += f", Preemptions: {c.num_preemptions}"
        return line, busy


async def log_stats_forever(engine: AsyncEngine, interval: float) -> None:
    """Log one stats line every `interval` seconds until cancelled."""
    stats_line = StatsLine(engine.latest, time.monotonic())
    while True:
        await asyncio.sleep(interval)
        line, busy = stats_line.format(engine.latest, time.monotonic())
        logger.log(logging.INFO if busy else logging.DEBUG, line)
