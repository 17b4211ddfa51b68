"""The admin API both servers serve and the operator calls: `GET`/`PATCH /admin/config`, its knobs, its
JSON, and the live max_tokens cap setting it changes.

The engine holds every knob; a proxy in front of vLLM or SGLang holds only the cap (max_num_seqs stays the
upstream's). A patch leaves absent fields as they are, and `"max_tokens_cap": null` removes the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvtune.contract.knobs import CAP_MODES, CapMode

ADMIN_CONFIG_PATH = "/admin/config"


# The response header a front sets whenever the cap changed a request's max_tokens.
CAP_HEADER = "X-Kvtune-Max-Tokens"


@dataclass(frozen=True)
class CapSetting:
    """The cap in force (None: no cap) and what a request above it gets. Replaced whole on a change, never
    mutated, so a reader on another thread never sees half of one."""

    cap: int | None = None
    mode: CapMode = "clamp"

    def __post_init__(self) -> None:
        if self.mode not in CAP_MODES:
            raise ValueError(f"cap mode must be one of {', '.join(CAP_MODES)}, got {self.mode!r}")
        if self.cap is not None and (isinstance(self.cap, bool) or self.cap < 1):
            raise ValueError(f"the max_tokens cap must be a positive integer, got {self.cap}")


class AdminBounds(BaseModel):
    """The largest value each knob accepts on this engine."""

    max_num_seqs: int
    max_tokens_cap: int


class AdminConfig(BaseModel):
    """The engine's answer."""

    max_num_seqs: int
    max_tokens_cap: int | None
    cap_mode: CapMode
    bounds: AdminBounds


class AdminConfigPatch(BaseModel):
    """The engine's patch: `cap_mode` says what a request over the cap gets (clamp: a lower max_tokens,
    reject: a 400)."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: StrictInt | None = Field(default=None, ge=1)
    max_tokens_cap: StrictInt | None = Field(default=None, ge=1)
    cap_mode: CapMode | None = None


class ProxyAdminConfig(BaseModel):
    """A proxy's answer: the cap alone."""

    max_tokens_cap: int | None
    cap_mode: CapMode


class ProxyAdminConfigPatch(BaseModel):
    """A proxy's patch: the cap alone (max_num_seqs is refused as an unknown field)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens_cap: StrictInt | None = Field(default=None, ge=1)
    cap_mode: CapMode | None = None
