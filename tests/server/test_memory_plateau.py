"""The engine's memory levels off under the soak's mixed load (a short `kvtune bench soak`, by rounds of
requests rather than by time): after a warm-up, malloc's bytes in use stop growing (oneDNN's primitive
caches are bounded, see kvtune/engine/model/onednn_caches.py), the Python heap grows only by the
prefix-defeat detector's bounded tables, no answer is a 5xx, and once the load is over the engine holds
no KV block and no more file descriptors than before it."""

from __future__ import annotations

import time
from pathlib import Path

from kvtune.bench import soak

ROUNDS = 6
PER_ROUND = 50
WARM_ROUNDS = 2
CLIENTS = 8
IN_USE_GROWTH_MB = 24.0  # after the warm-up; unbounded caches grew ~35 MB a round of 67 requests here
HEAP_GROWTH_MB = 8.0  # the detector's tables for one key are ~3 MB when full
RSS_GROWTH = 0.05  # over the last half of the rounds: what malloc's arenas keep free settles too


def test_memory_levels_off_and_the_engine_ends_where_it_began(tmp_path: Path) -> None:
    engine = soak.start(tmp_path / "engine.log", 1)
    pid, tally = engine.process.pid, soak.Tally()
    try:
        soak.wait_idle(engine.url)
        fds_before = soak.fds_of(pid)
        readings = [soak.read_engine(engine.url, pid, 0.0, 0)]
        for round_ in range(ROUNDS):
            soak.load_rounds(engine.url, CLIENTS, round_, tally, PER_ROUND)
            soak.wait_idle(engine.url)
            readings.append(soak.read_engine(engine.url, pid, float(round_ + 1), tally.requests))
        state = soak.wait_idle(engine.url)
        deadline = time.monotonic() + 30  # the clients' closes reach the engine: wait for that event
        while soak.fds_of(pid) > fds_before and time.monotonic() < deadline:
            time.sleep(0.1)
        fds_after = soak.fds_of(pid)
    finally:
        engine.stop()
    table = soak.format_table(readings)
    assert not tally.server_errors and not tally.unexpected, (tally.server_errors + tally.unexpected)[:5]
    assert tally.completed > 0 and tally.hung_up > 0 and tally.refused > 0, tally
    assert state["vllm:kv_cache_usage_perc"] == 0 and fds_after <= fds_before, (state, fds_before, fds_after)
    warm, last = readings[WARM_ROUNDS], readings[-1]
    assert warm.malloc_in_use is not None and last.malloc_in_use is not None, "glibc's mallinfo2 is needed"
    assert (last.malloc_in_use - warm.malloc_in_use) / 2**20 < IN_USE_GROWTH_MB, table
    assert warm.heap is not None and last.heap is not None and last.heap / 2**20 < HEAP_GROWTH_MB, table
    half = readings[len(readings) // 2]
    assert (last.rss - half.rss) / half.rss < RSS_GROWTH, table
