"""A Hugging Face checkpoint folder on disk: its config and its safetensors shards, read lazily by name.

The model asks for exactly the tensors it needs, so extra tensors in a checkpoint (old `inv_freq` buffers,
heads kvtune does not run) cost nothing, and a missing one is reported by name before any compute.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvtune.engine.model.model_config import ModelConfig, parse_model_config
from kvtune.errors import KvtuneError
from kvtune.front.text.hf_files import read_json, token_ids

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_READ_ERRORS = (OSError, RuntimeError, ValueError, SafetensorError)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder: the parsed config and where each tensor lives."""

    folder: Path
    config: ModelConfig
    tensor_files: dict[str, Path]

    def load_tensors(
        self, names: Iterable[str], dtype: torch.dtype, device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """Read `names` from their shards as `dtype` on `device`; KvtuneError naming the first missing one."""
        wanted = list(names)
        missing = [name for name in wanted if name not in self.tensor_files]
        if missing:
            raise KvtuneError(
                f"checkpoint {self.folder} lacks tensor {missing[0]!r}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            )
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.tensor_files[name], []).append(name)
        tensors: dict[str, torch.Tensor] = {}
        for path, file_names in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for name in file_names:
                        tensors[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
            except _READ_ERRORS as err:
                raise KvtuneError(f"cannot read {path}: {err}") from err
        return tensors


def _tensor_files(folder: Path) -> dict[str, Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise KvtuneError(f"{index} has no weight_map")
        files = {name: folder / str(shard) for name, shard in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise KvtuneError(f"{path} is missing (named by {INDEX_FILE})")
        return files
    single = folder / SINGLE_FILE
    shards = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not shards:
        raise KvtuneError(f"{folder} has no *.safetensors weights")
    files = {}
    for path in shards:
        try:
            with safe_open(str(path), framework="pt") as handle:
                files.update({name: path for name in handle.keys()})  # noqa: SIM118 (safe_open is not a dict)
        except _READ_ERRORS as err:
            raise KvtuneError(f"cannot read {path}: {err}") from err
    return files


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Open a checkpoint folder: parse config.json and index the tensors, reading no weights yet.

    EOS ids are the union of config.json's and generation_config.json's: instruct checkpoints often list
    their end-of-turn token only in the latter, and generation must stop on it.
    """
    path = Path(folder)
    if not path.is_dir():
        raise KvtuneError(f"model folder {path} does not exist")
    config = parse_model_config(read_json(path / "config.json"))
    generation = path / "generation_config.json"
    if generation.is_file():
        extra = token_ids(read_json(generation).get("eos_token_id"))
        merged = tuple(dict.fromkeys((*config.eos_token_ids, *extra)))
        config = replace(config, eos_token_ids=merged)
    return Checkpoint(folder=path, config=config, tensor_files=_tensor_files(path))
