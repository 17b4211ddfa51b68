"""The benchmarks' model checkpoints and the `kvtune serve` command line that serves them: which models there are,
where each checkpoint is kept, written on first use, and checked to be the model a section will name."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvtune.errors import KvtuneError

SERVED_MODEL_NAME = "tiny"
MODELS = ("tiny", "small")  # kvtune.engine.model.tiny_model.MODEL_SIZES, named here without importing torch


def default_model_dir(model: str = "tiny") -> Path:
    """Where the comparison keeps each model's checkpoint (written once by the tiny-model code, then
    reused); the tiny one's folder is the one it always had."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvtune" / f"bench-engine-{model}"


def model_description(model: str) -> str:
    """The checkpoint in words, with its shape and honest parameter count (for the recorded section)."""
    from kvtune.engine.model.tiny_model import MODEL_SIZES, describe

    command = "`kvtune tiny-model`" if model == "tiny" else f"`kvtune tiny-model --size {model}`"
    return f"the {model} checkpoint ({command}: {describe(MODEL_SIZES[model])})"


def serve_argv(
    args: argparse.Namespace, model_dir: Path, port: int, device: str, threads: int | None
) -> list[str]:
    """`kvtune serve` with a batch's pool and scheduler limits (prefix caching is on by default): the one
    command line both the CPU comparison and the GPU engine check start."""
    argv = [
        sys.executable, "-m", "kvtune.cli", "serve",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", args.dtype,
        "--device", device,
        "--block-size", str(args.block_size),
        "--kv-cache-tokens", str(args.kv_cache_tokens),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-model-len", str(args.max_model_len),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
    ]  # fmt: skip
    if threads is not None:
        argv += ["--threads", str(threads)]
    return argv


def ensure_model(model_dir: Path, model: str = "tiny") -> Path:
    """`model_dir`, with the `model`-size checkpoint written into it first if it holds none."""
    if not (model_dir / "config.json").is_file():
        from kvtune.engine.model.tiny_model import MODEL_SIZES, write_tiny_model

        print(f"writing the {model} checkpoint to {model_dir}", file=sys.stderr)
        write_tiny_model(model_dir, MODEL_SIZES[model])
    return model_dir


def check_model_shape(model_dir: Path, model: str) -> None:
    """The recorded section names the model and its parameter count, so a folder holding another shape
    (`--model small --model-dir` at the tiny one's folder) is a clear error, not a mislabelled benchmark."""
    from kvtune.engine.model.tiny_model import MODEL_SIZES

    spec = MODEL_SIZES[model]
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
        shape = (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise KvtuneError(f"{config_path}: not a readable checkpoint config ({err})") from err
    expected = (spec.num_layers, spec.hidden_size, spec.intermediate_size)
    if tuple(shape) != expected:
        raise KvtuneError(
            f"{model_dir} holds a model with (layers, hidden, intermediate) = {tuple(shape)}, not the {model} "
            f"model's {expected}: pass --model-dir a folder for the {model} model, or an empty one"
        )
