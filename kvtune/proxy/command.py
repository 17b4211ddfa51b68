"""`kvtune proxy --upstream URL --model-dir DIR`: the OpenAI-compatible pass-through in front of vLLM or
SGLang that enforces the max_tokens cap and watches prompts for prefix-cache defeats.

Flags share `kvtune serve`'s names where they mean the same thing. uvicorn runs programmatically and
`build_proxy` returns the pieces unstarted, so tests and the benchmark run the same proxy in a thread or a
subprocess on a socket of their choosing.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import uvicorn

from kvtune.contract.admin import CapSetting
from kvtune.core.prefix_defeats import PrefixDefeatDetector
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
from kvtune.proxy.app import ProxyCore, build_proxy_admin_app, build_proxy_app
from kvtune.proxy.metrics import ProxyMetrics
from kvtune.proxy.prefix_watch import PrefixWatch
from kvtune.proxy.prompt_tokens import PromptTokens
from kvtune.proxy.upstream import Upstream

logger = logging.getLogger("kvtune.proxy")

DEFAULT_UPSTREAM_TIMEOUT_S = 600.0
# The prefix watch's worker runs the detector in Python and keeps the GIL until the event loop has waited a
# switch interval for it: 5 ms by default, which a relayed event waits too. At 0.5 ms the loop's wake-up lag
# while the worker is busy fell from p50 2.7 / p90 5.2 / max 27 ms to 1.3 / 1.7 / 2.0 ms (0.7 ms idle).
SWITCH_INTERVAL_S = 0.0005


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--upstream", required=True, metavar="URL", help="the engine's base URL (vLLM, SGLang)"
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        metavar="DIR",
        help="the upstream model's checkpoint folder (tokenizer.json, chat template): prompts are tokenized "
        "as the upstream tokenizes them, for the prefix-defeat detector",
    )
    parser.add_argument("--block-size", type=int, default=16, help="the upstream's KV block size, in tokens")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        default=DEFAULT_UPSTREAM_TIMEOUT_S,
        metavar="S",
        help="seconds the upstream may stay silent (before its answer, or between streamed chunks) before "
        "the client gets a 504; connecting gets at most 10 s",
    )
    add_front_arguments(parser)
    parser.add_argument(
        "--uvicorn-access-log",
        action="store_true",
        help="log a line per request; off by default: the upstream logs each request already, and uvicorn "
        "writes the line before the answer's headers, on the path to the first token",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger bodies get a 413 before they are read (default: 4 MiB)",
    )


@dataclass
class ProxyServer:
    """A built proxy: its shared core and the uvicorn server(s) that run it."""

    core: ProxyCore
    server: uvicorn.Server
    admin_server: uvicorn.Server | None = None


def _check(args: argparse.Namespace) -> None:
    parts = urlsplit(args.upstream)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise KvtuneError(f"--upstream must be an http:// or https:// URL, got {args.upstream!r}")
    if not Path(args.model_dir).is_dir():
        raise KvtuneError(f"--model-dir {args.model_dir}: no such folder")
    if args.block_size < 1:
        raise KvtuneError(f"--block-size must be positive, got {args.block_size}")
    if args.max_tokens_cap is not None and args.max_tokens_cap < 1:
        raise KvtuneError(f"--max-tokens-cap must be positive, got {args.max_tokens_cap}")
    if args.upstream_timeout <= 0:
        raise KvtuneError(f"--upstream-timeout must be positive, got {args.upstream_timeout}")
    check_front_arguments(args)


def build_core(args: argparse.Namespace) -> ProxyCore:
    """The proxy's shared state from its flags (the tokenizer loaded, the upstream client made)."""
    _check(args)
    detector = PrefixDefeatDetector(args.block_size, keep_span_tokens=args.prefix_report_text)
    watch = PrefixWatch(
        detector, PromptTokens.from_model_dir(args.model_dir), report_text=args.prefix_report_text
    )
    return ProxyCore(
        upstream=Upstream(args.upstream, args.upstream_timeout),
        watch=watch,
        metrics=ProxyMetrics(detector),
        cap_setting=CapSetting(args.max_tokens_cap, args.cap_mode),
        prefix_key_header=args.prefix_key_header,
        max_request_body_bytes=args.max_request_body_bytes,
    )


def build_proxy(args: argparse.Namespace) -> ProxyServer:
    token = admin_token(args)
    core = build_core(args)
    app = build_proxy_app(core, admin_token=token, include_admin=args.admin_port is None)
    server = uvicorn.Server(front_config(app, args.host, args.port, args, access_log=args.uvicorn_access_log))
    admin = None
    if args.admin_port is not None:
        admin_app = build_proxy_admin_app(core, token)
        admin = uvicorn.Server(front_config(admin_app, args.host, args.admin_port, args))
    return ProxyServer(core, server, admin)


def run(args: argparse.Namespace) -> int:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # httpx logs every upstream request at INFO: a formatted line per request on the hot path.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    proxy = build_proxy(args)
    log_connection_limits(args)
    logger.info("proxying http://%s:%d to %s", args.host, args.port, proxy.core.upstream.base_url)
    serve(proxy.server, proxy.admin_server, args)
    return 0
