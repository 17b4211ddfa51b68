"""The alert path end to end on real parts: `kvtune serve` (a pool small enough to preempt) scraped by a
real Prometheus running the rendered rules, alerting through a real Alertmanager to a webhook sink.

The idle check runs first (pytest keeps file order): an engine nobody talks to raises nothing, neither at
the sink nor in Prometheus' own pending/firing list, over 15 evaluations of every rule group, although the
rules see it (`kvtune_engine:up` is 1 and its preemption increase is 0). Then a closed-loop load preempts it
and KVCachePreemptions must reach the webhook, naming the pod. Spans are counted in rule evaluations and
waits are for events; their deadlines only catch a hang.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtune.engine.model.tiny_model import write_tiny_model
from kvtune.harness.load import BackgroundLoad, LoadShape
from tests.observability.live_stack import LiveStack, ScrapeTarget, live_stack, wait_until
from tests.server.live_server import LiveServer, start_server

POD = "engine-0"
NAMESPACE = "kvtune-test"
IDLE_EVALUATIONS = 15  # rule evaluations the idle engine is watched over (one a second when nothing lags)
HANG_S = 120.0
SELECT = f'namespace="{NAMESPACE}", pod="{POD}"'


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """2048 KV tokens (128 blocks of 16) for up to 32 sequences: 16 clients of ~200 tokens overrun it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    live = start_server(
        write_tiny_model(tmp_path_factory.mktemp("tiny")),
        "--kv-cache-tokens", "2048", "--block-size", "16", "--max-num-seqs", "32",
    )  # fmt: skip
    yield live
    live.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stack(engine: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    target = ScrapeTarget(engine.url.removeprefix("http://"), pod=POD, namespace=NAMESPACE)
    with live_stack([target], tmp_path_factory.mktemp("stack")) as live:
        wait_until(
            lambda: live.value(f"kvtune_engine:up{{{SELECT}}}") == 1,
            30,
            "the engine in the kvtune_engine family",
        )
        yield live


def engine_alerts(alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All but KVTuneOperatorDown, which is pending here by design: this stack runs no operator."""
    return [a for a in alerts if a["labels"]["alertname"] != "KVTuneOperatorDown"]


def test_idle_engine_raises_nothing(stack: LiveStack) -> None:
    # EngineMetricsAbsent is pending until the first scrape lands; it must clear once the engine is seen.
    wait_until(
        lambda: not engine_alerts(stack.active_alerts()),
        HANG_S,
        "no pending alert once the engine is scraped",
    )
    until = stack.rule_evaluations() + IDLE_EVALUATIONS
    deadline = time.monotonic() + HANG_S
    while stack.rule_evaluations() < until:
        assert time.monotonic() < deadline, "Prometheus stopped evaluating its rules"
        assert engine_alerts(stack.active_alerts()) == []
        assert stack.sink.alerts() == []
        time.sleep(0.5)
    assert engine_alerts(stack.active_alerts()) == []
    assert stack.sink.alerts() == []
    assert stack.value(f"kvtune_engine:preemptions:increase5m{{{SELECT}}}") == 0
    assert stack.value(f"kvtune_engine:requests_running{{{SELECT}}}") == 0
    assert stack.value(f"kvtune_engine:kv_usage:ratio{{{SELECT}}}") == 0


def test_preempting_load_reaches_the_webhook(stack: LiveStack, engine: LiveServer) -> None:
    load = BackgroundLoad(
        engine.url, LoadShape(clients=16, prompt_len=(60, 100), output_len=(120, 200))
    ).start()
    try:
        alert = stack.sink.wait_for_alert("KVCachePreemptions", HANG_S, pod=POD, namespace=NAMESPACE)
    finally:
        tally = load.stop()
    assert tally.failures == []
    assert alert["labels"]["severity"] == "warning"
    assert alert["labels"]["model_name"] == "tiny"
    preempted = engine.counters().num_preemptions
    assert preempted > 0
    annotations = alert["annotations"]
    assert f"{NAMESPACE}/{POD}" in annotations["summary"]
    assert annotations["runbook_url"].endswith("/docs/runbooks/KVCachePreemptions.md")
    assert f'pod="{POD}"' in annotations["doctor"]
    # Prometheus agrees: the alert is firing there, and the family's counter is the engine's.
    firing = [a for a in stack.active_alerts() if a["labels"]["alertname"] == "KVCachePreemptions"]
    assert [a["state"] for a in firing] == ["firing"]
    total = wait_until(
        lambda: (
            stack.value(f"kvtune_engine:preemptions:total{{{SELECT}}}") == engine.counters().num_preemptions
        ),
        HANG_S,
        "kvtune_engine:preemptions:total to equal the engine's counter",
    )
    assert total
