"""A Hugging Face checkpoint's JSON files and token-id fields, read without torch.

The tokenizer, the checkpoint reader and the proxy (which runs in front of vLLM without torch) share them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtune.errors import KvtuneError


def read_json(path: Path) -> dict[str, Any]:
    """One JSON object from a checkpoint file, with a clear error for a missing or broken file."""
    if not path.is_file():
        raise KvtuneError(f"{path} is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KvtuneError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise KvtuneError(f"{path} must hold a JSON object")
    return data


def token_ids(value: Any) -> tuple[int, ...]:
    """`eos_token_id: 2` or `[1, 2]` as a tuple of ints (None: none)."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
