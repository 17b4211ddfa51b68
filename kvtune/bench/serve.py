"""`kvtune bench serve --url URL --model NAME`: a load generator for any OpenAI-compatible server.

It speaks only what vLLM and kvtune both accept: `/v1/completions` with the prompt as a list of token ids
(so prompt lengths are exact without knowing the tokenizer), `stream`, `stream_options.include_usage`,
`max_tokens` and vLLM's `ignore_eos`. Nothing kvtune-only is sent, so the same run measures either server.

Output lengths. Without `--max-tokens`, each request asks for `max_tokens` = its drawn output length; with
`--ignore-eos` the server then generates exactly that many tokens. With `--max-tokens M`, every request
declares `max_tokens` = M (what a client reserves) while its true output length stays the drawn one: the
client reads that many tokens and then closes the stream, which both servers treat as an abort that frees
the request's KV blocks. That reproduces "declared max_tokens far above the real output" on any server.

Preemptions are the difference of the server's `vllm:num_preemptions_total` (or the `vllm_` spelling)
scraped from `/metrics` before and after the run. The sending, timing and scraping are `kvtune.harness.load`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtune.errors import KvtuneError
from kvtune.harness.load import RequestResult, StreamedRequest, run_open_loop
from kvtune.sim.distributions import LengthDistribution


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass
class RequestPlan:
    """What to send: the request list and how each is declared (the catalog's loads are
    `kvtune.bench.workloads`)."""

    requests: list[BenchRequest]
    max_tokens: int | None
    ignore_eos: bool


def parse_token_range(spec: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in spec.split(":"))
    except ValueError:
        raise KvtuneError(f"--token-range must be LO:HI, got {spec!r}") from None
    if not 0 <= low < high:
        raise KvtuneError(f"--token-range needs 0 <= LO < HI, got {spec!r}")
    return low, high


def build_requests(args: argparse.Namespace, rng: np.random.Generator) -> list[BenchRequest]:
    """Random token-id prompts; a `shared_fraction` of them start with one common `shared_prefix`."""
    prompt_dist = LengthDistribution.parse(args.prompt_len)
    output_dist = LengthDistribution.parse(args.output_len)
    low, high = parse_token_range(args.token_range)
    n = args.num_requests
    prompt_lens = prompt_dist.sample(rng, n)
    output_lens = output_dist.sample(rng, n)
    prefix = rng.integers(low, high, size=args.shared_prefix).tolist()
    shared = rng.random(n) < args.shared_fraction if args.shared_prefix else np.zeros(n, dtype=bool)
    requests = []
    for i in range(n):
        own = rng.integers(low, high, size=int(prompt_lens[i])).tolist()
        requests.append(BenchRequest((prefix if shared[i] else []) + own, int(output_lens[i])))
    return requests


def base_url(url: str) -> str:
    """Accept `http://host:port`, with or without a trailing `/v1`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def request_body(model: str, request: BenchRequest, workload: RequestPlan) -> dict[str, Any]:
    """What one request sends: streamed, usage included, greedy; declared max_tokens per the workload."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt_ids,
        "max_tokens": workload.max_tokens or request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if workload.ignore_eos:
        body["ignore_eos"] = True
    return body


def streamed_requests(model: str, workload: RequestPlan) -> list[StreamedRequest]:
    """With a declared --max-tokens, each stream is read to its true output length and then closed."""
    read_to_true_length = workload.max_tokens is not None
    return [
        StreamedRequest(request_body(model, r, workload), r.output_len if read_to_true_length else None)
        for r in workload.requests
    ]


def _percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(np.asarray(values) * 1000.0, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3)}


def summarize(
    args: argparse.Namespace, results: list[RequestResult], duration: float, preemptions: float | None
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    generated = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    errors = sorted({r.error for r in results if r.error})
    return {
        "url": args.url,
        "model": args.model,
        "num_requests": len(results),
        "concurrency": args.concurrency,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "shared_prefix": args.shared_prefix,
        "shared_fraction": args.shared_fraction if args.shared_prefix else 0.0,
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "duration_s": round(duration, 3),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "generated_tokens_per_s": round(generated / duration, 2) if duration > 0 else 0.0,
        "total_tokens_per_s": round((generated + prompt) / duration, 2) if duration > 0 else 0.0,
        "ttft_ms": _percentiles_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _percentiles_ms([gap for r in ok for gap in r.itl]),
        "preemptions": None if preemptions is None else int(preemptions),
        "errors": errors[:5],
    }


def format_table(summary: dict[str, Any]) -> str:
    def ms(stats: dict[str, float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:.1f}" for v in stats.values())

    preemptions = summary["preemptions"]
    rows = [
        ("requests ok / failed", f"{summary['requests_ok']} / {summary['requests_failed']}"),
        ("duration", f"{summary['duration_s']:.2f} s"),
        ("generated tokens", str(summary["generated_tokens"])),
        ("generated tokens/s", f"{summary['generated_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{summary['total_tokens_per_s']:.1f}"),
        ("TTFT p50 / p90 / p99", f"{ms(summary['ttft_ms'])} ms"),
        ("ITL p50 / p90 / p99", f"{ms(summary['itl_ms'])} ms"),
        ("preemptions (server delta)", "n/a (no /metrics)" if preemptions is None else str(preemptions)),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"error: {err}" for err in summary["errors"]]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model name the server answers to")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, help="at most this many requests in flight")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    parser.add_argument("--prompt-len", default="uniform:300:700", help="length distribution, e.g. fixed:512")
    parser.add_argument("--output-len", default="uniform:500:1500", help="true output length distribution")
    parser.add_argument(
        "--max-tokens", type=int, help="declared max_tokens (default: the true output length)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="generate through EOS (vLLM's ignore_eos)")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens of a common system prompt")
    parser.add_argument(
        "--shared-fraction", type=float, default=1.0, help="fraction of requests that share it"
    )
    parser.add_argument("--token-range", default="32:127", help="prompt token ids are drawn from LO:HI")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json", metavar="FILE", help="also write the summary as JSON")


def _validate(args: argparse.Namespace) -> None:
    if args.num_requests < 1:
        raise KvtuneError(f"--num-requests must be positive, got {args.num_requests}")
    if args.concurrency is not None and args.concurrency < 1:
        raise KvtuneError(f"--concurrency must be positive, got {args.concurrency}")
    if not args.request_rate > 0:
        raise KvtuneError(f"--request-rate must be positive, got {args.request_rate}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise KvtuneError(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.shared_prefix < 0:
        raise KvtuneError(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
    if not 0.0 <= args.shared_fraction <= 1.0:
        raise KvtuneError(f"--shared-fraction must be between 0 and 1, got {args.shared_fraction}")
    if not args.url.startswith(("http://", "https://")):
        raise KvtuneError(f"--url must start with http:// or https://, got {args.url!r}")


def run(args: argparse.Namespace) -> int:
    _validate(args)
    rng = np.random.default_rng(args.seed)
    workload = RequestPlan(build_requests(args, rng), args.max_tokens, args.ignore_eos)
    results, duration, preemptions = asyncio.run(
        run_open_loop(
            base_url(args.url),
            streamed_requests(args.model, workload),
            request_rate=args.request_rate,
            concurrency=args.concurrency,
            seed=args.seed + 1,
            timeout_s=args.timeout,
        )
    )
    summary = summarize(args, results, duration, preemptions)
    print(format_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["requests_ok"] else 1
