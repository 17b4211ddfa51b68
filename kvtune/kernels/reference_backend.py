"""The reference backend as the registry sees it: the torch oracle plus the torch cache write."""

from __future__ import annotations

from kvtune.kernels.reference import decode, prefill
from kvtune.kernels.write import write_kv

__all__ = ["available", "decode", "prefill", "write_kv"]


def available() -> str | None:
    return None
