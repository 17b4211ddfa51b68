"""Every panel of every dashboard on real parts: a real Prometheus running the rendered rules scrapes a
`kvtune serve` that preempts under load (with a cap that clamps, and prompts whose timestamp defeats the
prefix cache) and the local operator tuning it, whose own /metrics it scrapes too. Every query of every panel
must return data; `kvtune report` then draws each panel from that Prometheus.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvtune.bench.proxy import shared_document, stamp
from kvtune.dashboards.panels import all_panel_queries
from kvtune.dashboards.report import all_variables
from kvtune.engine.model.tiny_model import write_tiny_model
from kvtune.harness.load import BackgroundLoad, LoadShape
from kvtune.harness.local_http import free_port
from tests.observability.live_stack import LiveStack, ScrapeTarget, live_stack, wait_until
from tests.server.live_server import LiveServer, start_server

POD = "engine-0"
NAMESPACE = "kvtune-test"
# a hang deadline: here the first preemption shows in ~6 s, every panel's data ~13 s later
DATA_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("admin") / "token"
    path.write_text("panel-test-token\n")
    os.chmod(path, 0o600)
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[LiveServer]:
    """A pool that 16 clients overrun (preemptions), a cap under what they ask for (clamps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    live = start_server(
        write_tiny_model(tmp_path_factory.mktemp("tiny")),
        "--kv-cache-tokens", "2048", "--block-size", "16", "--max-num-seqs", "32",
        "--max-tokens-cap", "120", "--admin-token-file", str(token_file), "--log-stats-interval", "0",
    )  # fmt: skip
    yield live
    live.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def operator_metrics(
    engine: LiveServer, token_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`kvtune operator --local` in Recommend mode (it evaluates and records, the load stays as it is)."""
    port = free_port()
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    argv = [
        sys.executable, "-m", "kvtune.cli", "operator", "--local", "--target", engine.url,
        "--admin-token-file", str(token_file), "--interval", "1", "--mode", "Recommend",
        "--metrics-port", str(port),
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(f"http://{address}/metrics"), 30, f"the operator's /metrics ({log})")
        yield address
    finally:
        process.terminate()
        process.wait(15)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def stack(
    engine: LiveServer, operator_metrics: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveStack]:
    targets = [
        ScrapeTarget(engine.url.removeprefix("http://"), pod=POD, namespace=NAMESPACE),
        ScrapeTarget(operator_metrics, pod="kvtune-operator-0", namespace=NAMESPACE),
    ]
    with live_stack(targets, tmp_path_factory.mktemp("stack")) as live:
        yield live


async def _defeated_chats(url: str, clients: int = 6) -> None:
    """Chat prompts that share a system prompt behind a timestamp: the detector's varying_head."""
    document = shared_document(7, 400)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for i in range(clients):
            body = {
                "messages": [
                    {"role": "system", "content": f"{stamp(i)} {document}"},
                    {"role": "user", "content": "hi"},
                ],
                "max_tokens": 1,
            }
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200


def _empty_queries(stack: LiveStack) -> list[str]:
    return [
        f"{q.dashboard_uid} / {q.panel_title}: {q.expr}"
        for q in all_panel_queries()
        if not stack.query(all_variables(q.expr))
    ]


def test_every_panel_query_returns_data_and_the_report_draws_them(
    engine: LiveServer, stack: LiveStack, tmp_path: Path
) -> None:
    asyncio.run(_defeated_chats(engine.url))
    shape = LoadShape(clients=16, prompt_len=(100, 200), output_len=(80, 160))
    # The cap clamps what asks above 120, so the load's own "tokens generated" check is not the point here.
    load = BackgroundLoad(engine.url, shape).start()
    try:
        wait_until(
            lambda: (stack.value(f'kvtune_engine:preemptions:total{{pod="{POD}"}}') or 0) > 0,
            DATA_TIMEOUT_S,
            "a preemption under load",
        )
        deadline = time.monotonic() + DATA_TIMEOUT_S
        empty = _empty_queries(stack)
        while empty and time.monotonic() < deadline:
            time.sleep(2)
            empty = _empty_queries(stack)
    finally:
        load.stop()
    assert not empty, "panel queries without data:\n" + "\n".join(empty)

    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "report", "--prometheus", stack.prometheus_url, "--since", "5m",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    pngs = sorted(out.glob("*.png"))
    panels = {(q.dashboard_uid, q.panel_title) for q in all_panel_queries()}
    assert len(pngs) == len(panels)
    index = (out / "index.html").read_text()
    assert all(png.name in index for png in pngs)
