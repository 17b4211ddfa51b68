"""The registry of attention backends and the rule that picks one for a device.

Backends are imported only when used, so a CPU engine never imports Triton and a machine without a C++
compiler can still run the reference.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtune.errors import KvtuneError

_MODULES = {
    "reference": "kvtune.kernels.reference_backend",
    "cpu": "kvtune.kernels.cpu_backend",
    "triton": "kvtune.kernels.triton_backend",
}
BACKEND_NAMES = tuple(_MODULES)


@dataclass(frozen=True)
class Backend:
    """One implementation of the kernels interface: its functions run unchecked (kernels.api checks).

    The engine's model resolves one at load and calls these directly on every layer, so the per-layer hot
    path neither looks a backend up nor re-validates what the step's batch builder validated once.
    """

    name: str
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]
    write_kv: Callable[..., None]


def _module(name: str) -> Any:
    if name not in _MODULES:
        raise KvtuneError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError as err:
        raise KvtuneError(f"attention backend {name!r} cannot be imported: {err}") from err


def unavailable_reason(name: str) -> str | None:
    """None when backend `name` can run on this machine, else why it cannot."""
    try:
        reason: str | None = _module(name).available()
    except KvtuneError as err:
        return str(err)
    return reason


def get_backend(name: str) -> Backend:
    """The backend called `name`, or a KvtuneError saying why it cannot run here."""
    reason = unavailable_reason(name)
    if reason is not None:
        raise KvtuneError(f"attention backend {name!r} is unavailable: {reason}")
    module = _module(name)
    return Backend(name, module.decode, module.prefill, module.write_kv)


def select_backend(device: torch.device | str) -> str:
    """Triton on CUDA; the in-place CPU kernel elsewhere, or the reference if it cannot be built."""
    if torch.device(device).type == "cuda":
        return "triton"
    return "cpu" if unavailable_reason("cpu") is None else "reference"


def resolve_backend(name: str | None, device: torch.device | str) -> Backend:
    """Backend `name`, or the device's best (`select_backend`) when `name` is None."""
    return get_backend(name if name is not None else select_backend(device))
