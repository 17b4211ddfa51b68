"""Whether an engine restarted between two samples, what the operator holds that a restarted engine lost,
and whether its KV pool changed.

A restarted engine forgot every knob the operator set (it is back at its flags), and its counters count
from zero, so samples from before the restart describe another process: the operator drops them and
re-applies its desired values at once (see `loop.step`). Telling a restart from a source that alternates
between processes is `continuity.judge`'s job; `engine_restarted` asks it about two samples.
"""

from __future__ import annotations

from kvtune.operator.decide.continuity import RESTART, Continuity, judge
from kvtune.operator.decide.sample import Sample


def engine_restarted(before: Sample, after: Sample) -> str | None:
    """Why `after` comes from a newer engine process than `before` (its start time moved, or, without
    start times, a counter fell), or None when it is the same one or another process answering."""
    seen = judge(Continuity(), before, float("inf")).continuity
    judged = judge(seen, after, float("inf"))
    return judged.reason if judged.kind == RESTART else None


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
