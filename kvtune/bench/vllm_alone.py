"""`python -m kvtune.bench.vllm_alone`: vLLM alone on the saturating workload, as one JSON record.

Starts vLLM's CPU build on a checkpoint with the comparison's settings (KV pool in tokens, block size,
max_num_seqs, max_model_len), runs the saturating load against it, stops it, and prints the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from kvtune.bench.vllm_cpu import (
    DEFAULT_VENV_DIR,
    VllmServerConfig,
    ensure_venv,
    installed_versions,
    start_server,
    venv_python,
)
from kvtune.errors import KvtuneError
from kvtune.harness.load import BatchSpec, run_batch


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvtune.bench.vllm_alone", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV_DIR)
    parser.add_argument("--kv-cache-tokens", type=int, default=65_536)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default=None, help="default: the checkpoint's dtype")
    parser.add_argument("--cpu-threads", type=int, default=None, help="default: vLLM's auto binding")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(300, 700))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(500, 1500))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, default=None, help="vLLM's log file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = VllmServerConfig(
        model_dir=args.model_dir,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        dtype=args.dtype,
        cpu_threads=args.cpu_threads,
    )
    spec = BatchSpec(
        num_requests=args.num_requests,
        prompt_tokens=tuple(args.prompt_tokens),
        output_tokens=tuple(args.output_tokens),
        seed=args.seed,
    )
    try:
        ensure_venv(args.venv)
        boot_start = time.perf_counter()
        with start_server(config, venv_dir=args.venv, log_path=args.log) as server:
            boot_s = time.perf_counter() - boot_start
            result = asyncio.run(run_batch(server.url, config.served_model_name, spec))
            record = {
                "engine": "vllm-cpu",
                "versions": installed_versions(args.venv),
                "command": config.command(venv_python(args.venv), server.port),
                "cpu_threads": config.cpu_threads or "auto",
                "dtype": config.resolved_dtype(),
                "kv_cache_tokens_usable": config.kv_cache_tokens,
                "kv_cache_tokens_reported": server.kv_cache_tokens(),
                "boot_s": round(boot_s, 1),
                **result.as_dict(),
            }
    except KvtuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
