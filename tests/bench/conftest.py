"""Fixtures the benchmark tests share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY_CONFIG = {
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_size": 256,
    "torch_dtype": "float32",
}


@pytest.fixture()
def tiny_config_dir(tmp_path: Path) -> Path:
    """A folder holding only the tiny checkpoint's config.json: all that sizing a KV pool or building a
    server's argv reads, without writing weights."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path
