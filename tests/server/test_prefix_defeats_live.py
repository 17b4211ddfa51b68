"""The prefix-defeat detector's closed loop on `kvtune serve`, driven the way a chat deployment defeats it.

64 concurrent clients share a system prompt. With a timestamp at its head, every prompt is
unique from its first block, so the prefix cache hits nothing and /kvtune/prefix-report names
`varying_head`, with the varying span at the head. With the timestamp moved to the end, the cache serves
the shared prompt (every client after the first hits all of it; above 90% of all prompt tokens at the
issue's length) and the report finds nothing. The two phases use different documents
and different tenants (`--prefix-key-header`), so neither can learn from the other.

The issue's ~2,000-token prompt runs with --runslow: 64 unique 2,000-token prefills take over two minutes
on a 2-core machine (the CPU attention kernel is quadratic in the prompt), so the default run shares a
512-token prompt, the same loop at a quarter of the length.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune.bench.proxy import shared_document, stamp
from kvtune.core.prefix_defeats import REASONS
from tests.server.live_server import LiveServer, Samples, scrape, start_server, total
from tests.stand_in_http import QuietHandler

CLIENTS = 64
# Shared system prompts, in characters: the tiny tokenizer is byte-level, one token per character.
DOCUMENT_LENGTHS = [512, pytest.param(2000, marks=pytest.mark.slow)]
TENANT_HEADER = "X-Tenant"
HEAD_TOKENS = 1 + len("system: ")  # the chat template's <|begin_of_text|>, then the role (byte tokens)
REPORT = "/kvtune/prefix-report"


@pytest.fixture(scope="module")
def roomy_server(tiny_dir: Path) -> Iterator[LiveServer]:
    """Room for the shared prompt and many clients' own tails; a 512-token step budget, so the first
    prompt's prefill is scheduled (and its blocks cached) before the others are admitted, as on a busy
    server; the detector keyed by tenant; span text in the report (the opt-in)."""
    live = start_server(
        tiny_dir,
        "--kv-cache-tokens", "16384", "--block-size", "16", "--max-num-seqs", "64",
        "--max-num-batched-tokens", "512", "--max-model-len", "4096", "--max-waiting-requests", "-1",
        "--prefix-key-header", TENANT_HEADER, "--prefix-report-text", "--log-stats-interval", "0",
    )  # fmt: skip
    yield live
    live.stop()


async def _send_all(url: str, tenant: str, systems: list[str]) -> None:
    limits = httpx.Limits(max_connections=len(systems))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(system: str) -> None:
            body = {
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "temperature": 0,
            }
            response = await http.post("/v1/chat/completions", json=body, headers={TENANT_HEADER: tenant})
            assert response.status_code == 200, response.text

        await asyncio.gather(*(one(system) for system in systems))


def _prefix_cache_traffic(
    server: LiveServer, http: httpx.Client, tenant: str, systems: list[str], length: int
) -> tuple[float, float]:
    """(hit tokens, queried tokens) of the prefix cache while every client sends its one prompt."""
    before = scrape(http)
    asyncio.run(_send_all(server.url, tenant, systems))
    server.wait_idle()
    after = scrape(http)

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    queries = delta("vllm:prefix_cache_queries_total")
    assert queries >= CLIENTS * length
    return delta("vllm:prefix_cache_hits_total"), queries


class ScrapeRelay:
    """Passes GETs on to the server unchanged and counts the /metrics reads, so a test knows when the doctor
    has taken its first sample instead of guessing how long its start takes."""

    def __init__(self, upstream: str) -> None:
        self.scrapes = 0
        relay = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "authorization")}
                answer = httpx.get(f"{upstream}{self.path}", headers=headers, timeout=60)
                self.send_whole(
                    answer.status_code, answer.content, answer.headers.get("content-type", "text/plain")
                )
                if self.path.startswith("/metrics"):
                    relay.scrapes += 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class DoctorDuringTraffic:
    """`kvtune doctor --json` sampling the server while the clients send, as a user would run it on a
    live incident: the defeats it names are the ones that moved in its window. Its first sample is taken
    before the clients start (waited for through a relay that counts its scrapes; the deadline only catches
    a hang), and its second `window_s` later, once some of their requests are in."""

    def __init__(self, url: str, window_s: float = 4.0) -> None:
        self.relay = ScrapeRelay(url)
        argv = [sys.executable, "-m", "kvtune.cli", "doctor", "--metrics-url", self.relay.url, "--json",
                "--window-seconds", str(window_s), "--samples", "2"]  # fmt: skip
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while self.relay.scrapes < 1:
            assert self.process.poll() is None, self.process.communicate()[1]
            assert time.monotonic() < deadline, "the doctor took no sample"
            time.sleep(0.02)

    def report(self) -> dict[str, Any]:
        try:
            out, err = self.process.communicate(timeout=120)
        finally:
            self.relay.stop()
        assert self.process.returncode == 0, err
        data: dict[str, Any] = json.loads(out)
        return data


def _flag(report: dict[str, Any]) -> dict[str, Any]:
    (flag,) = [r for r in report["remedies"] if r["remedy"] == "flag_prefix_defeat"]
    return flag


def _defeats(samples: Samples) -> dict[str, float]:
    return {labels["reason"]: value for labels, value in samples["kvtune:prefix_defeats_total"]}


def test_the_report_and_the_counters_start_empty_with_every_reason(roomy_server: LiveServer) -> None:
    with httpx.Client(base_url=roomy_server.url, timeout=30) as http:
        samples = scrape(http)
        report = http.get(REPORT).json()
        documented = http.get("/openapi.json").json()["paths"]
    assert "get" in documented[REPORT]  # so the API fuzz drives it too
    for name in ("kvtune:prefix_defeats_total", "kvtune:prefix_defeat_tokens_total"):
        series = {labels["reason"]: value for labels, value in samples[name]}
        assert series == dict.fromkeys(REASONS, 0.0), name
        assert all(labels["model_name"] == "tiny" for labels, _ in samples[name])
    assert report["enabled"] is True and report["key"] == f"header:{TENANT_HEADER}"
    assert (report["block_size"], report["observed"]) == (16, 0)
    assert set(report["reasons"]) == set(REASONS) == set(report["fixes"])
    for entry in report["reasons"].values():
        assert entry == {"defeats": 0, "tokens_lost": 0, "examples": []}
    assert report["limits"]["max_state_entries"] > 0


@pytest.mark.parametrize("length", DOCUMENT_LENGTHS)
def test_a_timestamp_at_the_head_defeats_the_cache_and_is_named(
    roomy_server: LiveServer, length: int
) -> None:
    shared = shared_document(length, length)
    systems = [f"{stamp(i)} {shared}" for i in range(CLIENTS)]
    with httpx.Client(base_url=roomy_server.url, timeout=30) as http:
        before = http.get(REPORT).json()
        doctor = DoctorDuringTraffic(roomy_server.url)
        hits, queries = _prefix_cache_traffic(roomy_server, http, f"head-{length}", systems, length)
        report = http.get(REPORT).json()
        samples = scrape(http)
        defeats = _defeats(samples)
        diagnosis = doctor.report()
    # At most the first block hits: "<bos>system: " and the timestamps' common "[2026-1" fill it.
    assert hits <= CLIENTS * 16 and hits / queries < 0.03
    assert report["observed"] - before["observed"] == CLIENTS
    head = report["reasons"]["varying_head"]
    new_defeats = head["defeats"] - before["reasons"]["varying_head"]["defeats"]
    assert new_defeats == CLIENTS - 1  # every client after the first shares the document with an earlier one
    assert defeats["varying_head"] == head["defeats"]
    # the detector's own time, exported so its cost to the engine is measured where it runs
    ((_, spent),) = samples["kvtune:prefix_detector_seconds_total"]
    assert 0 < spent < 60 and report["observe_seconds"] == pytest.approx(spent, abs=0.01)
    lost = head["tokens_lost"] - before["reasons"]["varying_head"]["tokens_lost"]
    assert lost >= (CLIENTS - 1) * (length - 2 * 16)
    example: dict[str, Any] = head["examples"][-1]
    # The varying span lies in the head: after "<bos>system: " and within the timestamp; then the document.
    span_end = example["span_start"] + example["span_length"]
    head_end = HEAD_TOKENS + len(stamp(0)) + 1
    assert 0 < example["span_start"] < span_end <= example["shared_start"] <= head_end
    assert example["shared_length"] >= length - 16
    assert "req-" in example["text"]  # --prefix-report-text: the span decoded
    assert "move the varying span" in report["fixes"]["varying_head"]
    others = {
        reason: entry["defeats"] for reason, entry in report["reasons"].items() if reason != "varying_head"
    }
    assert others == {reason: before["reasons"][reason]["defeats"] for reason in others}
    # The doctor, sampling during the incident, names the reason, where the span lies, and the fix.
    flag = _flag(diagnosis)
    assert flag["applicable"] and "varying_head" in flag["recommended"]
    named = {e["reason"]: e for e in diagnosis["prefix_report"]["defeats"] if e["in_window"]}
    assert set(named) == {"varying_head"}
    assert named["varying_head"]["where"].startswith("tokens ") and "vary" in named["varying_head"]["where"]
    assert "move the varying span" in named["varying_head"]["fix"]


@pytest.mark.parametrize("length", DOCUMENT_LENGTHS)
def test_the_timestamp_moved_to_the_end_lets_the_cache_serve_and_flags_nothing(
    roomy_server: LiveServer, length: int
) -> None:
    shared = shared_document(length + 1, length)
    systems = [f"{shared} {stamp(i)}" for i in range(CLIENTS)]
    with httpx.Client(base_url=roomy_server.url, timeout=30) as http:
        before = http.get(REPORT).json()
        doctor = DoctorDuringTraffic(roomy_server.url)
        hits, queries = _prefix_cache_traffic(roomy_server, http, f"tail-{length}", systems, length)
        report = http.get(REPORT).json()
        diagnosis = doctor.report()
    # Every client after the first hits the whole blocks of "<bos>system: " + the document + " ", bar at
    # most one that was admitted while the first one's last chunk was still being computed.
    whole_blocks = (HEAD_TOKENS + length + 1) // 16 * 16
    assert hits >= (CLIENTS - 2) * whole_blocks
    if length >= 2000:
        assert hits / queries > 0.9  # the figure, for its ~2,000-token prompt
    assert report["observed"] - before["observed"] == CLIENTS
    new_findings = {
        reason: entry["defeats"] - before["reasons"][reason]["defeats"]
        for reason, entry in report["reasons"].items()
    }
    assert new_findings == dict.fromkeys(REASONS, 0)
    # The doctor, sampling while the clients send, flags nothing: no defeat moved in its window.
    assert not _flag(diagnosis)["applicable"]
    assert not [e for e in (diagnosis["prefix_report"] or {}).get("defeats", []) if e["in_window"]]


def test_the_report_says_when_the_detector_is_off(tiny_dir: Path) -> None:
    live = start_server(
        tiny_dir, "--kv-cache-tokens", "1024", "--no-prefix-detector", "--log-stats-interval", "0"
    )
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            response = http.post("/v1/completions", json={"prompt": "x" * 64, "max_tokens": 1})
            assert response.status_code == 200
            report = http.get(REPORT).json()
            samples = scrape(http)
    finally:
        live.stop()
    assert report["enabled"] is False and "--no-prefix-detector" in report["reason"]
    assert "kvtune:prefix_defeats_total" not in samples  # not watched is not "no defeats"
