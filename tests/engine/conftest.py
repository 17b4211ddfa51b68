"""Engine model tests compare against Hugging Face transformers (a test-only dependency) on checkpoints
written into a session temp folder: the tiny model once, and small random models of each architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtune.engine_sidecar.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def transformers() -> Any:
    return pytest.importorskip("transformers", reason="transformers (test-only dependency) is not installed")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def hf_tiny(transformers: Any, tiny_dir: Path) -> Any:
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
