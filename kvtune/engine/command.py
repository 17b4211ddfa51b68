"""`kvtune serve --model DIR | --tiny`: the engine behind an OpenAI-compatible HTTP server.

Flags mirror vLLM's names so that a deployment (and the operator, which rewrites them) treats both alike.
Boot logs use vLLM's wording (`CPU KV cache size: N tokens`, `Maximum concurrency for M tokens per
request: X.XXx`) so log parsers written for vLLM read kvtune too. uvicorn runs programmatically, so tests
start the same server in a thread on a socket of their choosing.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI

from kvtune.core.allocators import POLICIES
from kvtune.engine.http.app import build_admin_app, build_app
from kvtune.engine.http.memory_report import start_tracing_from_env
from kvtune.engine.loop.compute_threads import allowed_cores, default_compute_threads, engine_cores
from kvtune.engine.loop.llm_engine import LLMEngine
from kvtune.engine.loop.thread import AsyncEngine
from kvtune.engine.model.engine_config import EngineConfig
from kvtune.engine.model.onednn_caches import bound_onednn_caches
from kvtune.engine.model.step_threads import Width
from kvtune.engine.model.tiny_model import write_tiny_model
from kvtune.errors import KvtuneError
from kvtune.front.body import DEFAULT_MAX_REQUEST_BODY_BYTES
from kvtune.front.flags import (
    LOG_FORMAT,
    add_front_arguments,
    admin_token,
    check_front_arguments,
    front_config,
    log_connection_limits,
    serve,
)

logger = logging.getLogger("kvtune.engine.command")


def tiny_model_dir() -> Path:
    """Where `--tiny` keeps the embedded default checkpoint (written once, then reused)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvtune" / "tiny"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint folder")
    source.add_argument(
        "--tiny", action="store_true", help=f"serve the embedded tiny model ({tiny_model_dir()})"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", help="the model name the API answers to (default: folder name)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto, float32, float16 or bfloat16; auto is the checkpoint's dtype, except that a float32 "
        "checkpoint runs in bfloat16 on a CPU with AVX512-BF16, as vLLM runs it (the boot log says which)",
    )
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-tokens", type=int, help="KV pool size in tokens")
    parser.add_argument("--kv-cache-memory-bytes", type=int, help="KV pool size in bytes")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--allocator", default="paged", choices=sorted(POLICIES))
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        help="refuse new requests (429, Retry-After) once this many wait; default 4 x --max-num-seqs "
        "(retuning max_num_seqs live leaves it as it is); -1: no limit; 0: refuse every new request",
    )
    parser.add_argument(
        "--no-prefix-detector",
        action="store_true",
        help="do not watch prompts for prefix-cache defeats (/kvtune/prefix-report then says it is off)",
    )
    add_front_arguments(parser)
    parser.add_argument("--attention-backend", help="kvtune.kernels backend (default: the device's best)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads, for every step (default: every core but one, which the HTTP side keeps, and "
        "every core for the step sizes that time faster on all of them; 1 on a single core)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds torch's global generator once at boot (as vLLM's --seed): requests without a seed of "
        "their own draw from it, so a server restarted with the same seed and sent the same requests in "
        "the same order samples the same tokens; a request's own seed makes it independent of the others",
    )
    parser.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="read special-token text inside chat messages (e.g. <|eot_id|>) as special tokens, as vLLM "
        "does; by default it is plain text, so a message cannot end its turn or forge another role",
    )
    parser.add_argument("--log-stats-interval", type=float, default=5.0, help="seconds; 0 turns it off")
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger bodies get a 413 before they are read (default: 4 MiB, a 128k-token prompt with room)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.tiny:
        folder = tiny_model_dir()
        if not (folder / "config.json").is_file():
            write_tiny_model(folder)
        model = str(folder)
    else:
        model = args.model
        if not Path(model).is_dir():
            raise KvtuneError(f"--model {model}: no such folder")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig(
        model=model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=device,
        block_size=args.block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        allocator=args.allocator,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend,
        max_tokens_cap=args.max_tokens_cap,
        cap_mode=args.cap_mode,
        prefix_detector=not args.no_prefix_detector,
        prefix_report_text=args.prefix_report_text,
        seed=args.seed,
    )


def log_dtype(engine: LLMEngine) -> None:
    """One boot line: the dtype the model runs in, and why `--dtype` chose it."""
    choice = engine.runner.dtype_choice
    logger.info("Serving in %s (%s)", choice.name, choice.reason)


def log_capacity(engine: LLMEngine) -> None:
    """vLLM's two boot lines; concurrency assumes every request uses the full max_model_len, as vLLM's."""
    pool = engine.cache.num_tokens
    kind = "GPU" if engine.runner.device.type == "cuda" else "CPU"
    logger.info("%s KV cache size: %s tokens", kind, f"{pool:,}")
    logger.info(
        "Maximum concurrency for %s tokens per request: %.2fx",
        f"{engine.max_model_len:,}",
        pool / engine.max_model_len,
    )


UvicornServer = uvicorn.Server  # the name `uvicorn` is a field inside Server


@dataclass
class Server:
    """A built server: the engine, its thread wrapper, the app, and the uvicorn server that runs it."""

    engine: LLMEngine
    async_engine: AsyncEngine
    app: FastAPI
    uvicorn: uvicorn.Server
    admin_uvicorn: UvicornServer | None = None  # with --admin-port: the admin API's own server


def build_server(args: argparse.Namespace) -> Server:
    if args.threads is not None and args.threads < 1:
        raise KvtuneError(f"--threads must be positive, got {args.threads}")
    if args.log_stats_interval < 0:
        raise KvtuneError(f"--log-stats-interval must be >= 0, got {args.log_stats_interval}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < -1:
        raise KvtuneError(
            f"--max-waiting-requests must be >= 0, or -1 for no limit; got {args.max_waiting_requests}"
        )
    check_front_arguments(args)
    token = admin_token(args)
    cores = allowed_cores()
    threads = args.threads or default_compute_threads(len(cores))
    # Only the engine thread computes on several threads: it sets its own count when it starts. The model loads
    # here on one, so this thread never starts an OpenMP team of its own. libgomp spins at a barrier only while
    # it manages no more threads than there are cores; with a second team idling here, every parallel region
    # of the engine's team slept and woke through the kernel (the small model's decode step on 2 cores of an
    # AMX Xeon: 33 ms in one process with one team, 42 ms with two).
    torch.set_num_threads(1)
    pinned = engine_cores(cores, threads)  # as vLLM binds its compute threads; the first core: HTTP
    logger.info(
        "Computing on %d torch thread%s%s", threads, "" if threads == 1 else "s",
        "" if pinned is None else f", the engine thread pinned to core(s) {sorted(pinned)}"
        + ("" if args.threads else f"; on all {len(cores)} for the step sizes timed faster there"),
    )  # fmt: skip
    bound_onednn_caches()  # before the engine's first matmul
    config = engine_config(args)
    engine = LLMEngine(config)
    if args.threads is None and pinned is not None and config.device == "cpu":
        # the core left to HTTP idles through most steps: lend it to the step sizes that run faster on it
        engine.runner.adapt_threads(Width(threads, pinned), Width(len(cores), frozenset(cores)))
    engine.tokenizer.parse_special_tokens_in_content = args.allow_special_tokens_in_content
    log_dtype(engine)
    log_capacity(engine)
    async_engine = AsyncEngine(
        engine, max_waiting_requests=args.max_waiting_requests, engine_cores=pinned, compute_threads=threads
    )
    app = build_app(
        async_engine,
        admin_token=token,
        log_stats_interval=args.log_stats_interval or None,
        model_root=config.model,
        max_request_body_bytes=args.max_request_body_bytes,
        include_admin=args.admin_port is None,
        prefix_key_header=args.prefix_key_header,
    )
    server = uvicorn.Server(front_config(app, args.host, args.port, args))
    admin = None
    if args.admin_port is not None:
        admin_app = build_admin_app(async_engine, token, args.max_request_body_bytes)
        admin = uvicorn.Server(front_config(admin_app, args.host, args.admin_port, args))
    start_tracing_from_env()  # from here on: what serving allocates, not the imports and the model load
    return Server(engine, async_engine, app, server, admin)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    server = build_server(args)
    log_connection_limits(args)
    logger.info("serving %s on http://%s:%d", server.engine.served_model_name, args.host, args.port)
    serve(server.uvicorn, server.admin_uvicorn, args)
    return 0
