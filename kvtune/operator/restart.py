"""Whether an engine restarted between two samples: its process start time moved, or a counter fell.

A restarted engine forgot every knob the operator set (it is back at its flags), and its counters count
from zero, so samples from before the restart describe another process: the operator drops them and
re-applies its desired values at once (see `local.step`).
"""

from __future__ import annotations

from kvtune.operator.metric_names import PROCESS_START
from kvtune.operator.sample import Sample


def engine_restarted(before: Sample, after: Sample) -> str | None:
    """Why `after` comes from a newer engine process than `before`, or None when it is the same one."""
    started_before, started_after = before.gauges.get(PROCESS_START), after.gauges.get(PROCESS_START)
    if started_before is not None and started_after is not None and started_after != started_before:
        return f"process_start_time_seconds moved {started_before:.2f} -> {started_after:.2f}"
    fallen = sorted(
        name
        for name, value in before.counters.items()
        if name in after.counters and after.counters[name] < value
    )
    if fallen:
        name = fallen[0]
        more = f" (and {len(fallen) - 1} more)" if len(fallen) > 1 else ""
        return f"counter {name} fell {before.counters[name]:g} -> {after.counters[name]:g}{more}"
    return None


def drifted(
    desired: dict[str, int | str | None], current: dict[str, int | str | None]
) -> dict[str, int | str | None]:
    """The desired knob values the engine does not hold now (knobs it does not report are left alone)."""
    return {knob: value for knob, value in desired.items() if knob in current and current[knob] != value}


def pool_changed(before: Sample, after: Sample) -> str | None:
    """Why the restarted engine's KV pool differs from the old one's (kv_cache_size_tokens, from
    vllm:cache_config_info), or None when it is the same or either does not say."""
    old, new = before.cache_config.get("kv_cache_size_tokens"), after.cache_config.get("kv_cache_size_tokens")
    if old is None or new is None or old == new:
        return None
    return f"KV pool {int(old):,} -> {int(new):,} tokens"
