"""The knobs the operator tunes, by the names the admin JSON, the actuators and the status use. Apart from
`admin` (the API's schema) so the operator's pure decisions read them without the HTTP models."""

from __future__ import annotations

from typing import Literal

KNOB_MAX_NUM_SEQS = "max_num_seqs"
KNOB_MAX_TOKENS_CAP = "max_tokens_cap"
KNOB_KV_CACHE_DTYPE = "kv_cache_dtype"  # a restart flag, never an admin field: the operator recommends it

CapMode = Literal["clamp", "reject"]  # what a request above the max_tokens cap gets
CAP_MODES: tuple[CapMode, ...] = ("clamp", "reject")
