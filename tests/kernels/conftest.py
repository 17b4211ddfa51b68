"""Kernel tests run the real Triton kernels on a CPU through the interpreter.

TRITON_INTERPRET must be set before any @triton.jit decorator runs, so it is set here, at collection, when
there is no CUDA device. The full grid runs with --runslow (or KVTUNE_RUNSLOW=1).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    with contextlib.suppress(ValueError):  # already registered by a conftest higher up
        parser.addoption("--runslow", action="store_true", default=False, help="run the full kernel grids")
