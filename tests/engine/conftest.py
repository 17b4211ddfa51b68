"""Engine model tests compare against Hugging Face transformers (a test-only dependency) on checkpoints
written into a session temp folder: the tiny model once, and small random models of each architecture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtune.engine.model.tiny_model import write_tiny_model


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """The test models are tiny: one thread is faster, and on a loaded 2-core machine OpenMP threads that
    spin-wait for each other made the suite 6x slower (10 s against 62 s, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def transformers() -> Any:
    return pytest.importorskip("transformers", reason="transformers (test-only dependency) is not installed")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def hf_tiny(transformers: Any, tiny_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
