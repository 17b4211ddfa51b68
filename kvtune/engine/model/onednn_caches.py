"""Bound oneDNN's primitive caches before the first bfloat16 matmul.

On a CPU with AVX512-BF16 the engine runs its linear layers in bfloat16 through oneDNN (see
`serving_dtype`), and PyTorch keeps every oneDNN primitive it builds in two LRU caches keyed by shape
(ideep's, `LRU_CACHE_CAPACITY`, and oneDNN's own, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`; 1,024 entries
each by default). Continuous batching makes a new shape of almost every step (the tokens in a batch),
so under the soak's mixed load malloc's bytes in use climbed to ~696 MB before both caches were full, and
the evictions that followed kept RSS growing. At 64 entries each the soak levels off at 895 MB RSS
(191 MB in use), and the same 160 requests ran within the noise of the default (BENCHMARKS.md, "Soak").
A value the environment already sets is left alone.
"""

from __future__ import annotations

import os

ONEDNN_CACHE_ENTRIES = 64
CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(entries: int = ONEDNN_CACHE_ENTRIES) -> dict[str, str]:
    """Set both cache capacities to `entries` where the environment does not set them (oneDNN reads them
    when it builds its first primitive); returns the values in force."""
    for name in CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in CACHE_VARIABLES}
