"""The in-cluster operator's own /metrics, against kmock's Kubernetes API and real HTTP metrics: kopf runs the
handlers with the served registry in its memo (as `kvtune operator --metrics-port` wires it), and a scrape
shows the action (counter, timestamp), the knobs current and recommended, the rung, the conditions, the
ceilings and a recent evaluation; unreachable metrics, a missing admin Secret and an unwritable status are
counted as no-data and errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import kopf
import pytest

import kvtune.operator.k8s.handlers  # noqa: F401  (registers the handlers with kopf)
from kvtune.operator.io.own_metrics import OperatorMetrics
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.kube_api import KubeApi
from kvtune.operator.k8s.reconcile import PolicyMemory, PolicyTick, run_once
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.helpers import OPERATOR_SERIES, Series, parse_series, series_names, series_value
from tests.operator.kmock_world import (
    NS,
    OptimisticEmulator,
    add_deployment,
    add_policy,
    container_args,
    our_events,
    policy_spec,
)


@pytest.fixture
def served() -> Iterator[tuple[OperatorMetrics, str]]:
    """An OperatorMetrics served on a free loopback port, as `--metrics-port` serves it."""
    metrics = OperatorMetrics()
    server = metrics.serve(0, "127.0.0.1")
    yield metrics, f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()


def scrape(url: str) -> Series:
    response = httpx.get(url, timeout=5)
    response.raise_for_status()
    return parse_series(response.text)


def ticks(spec: dict[str, Any], metrics: OperatorMetrics, count: int) -> None:
    parsed = KVTuningPolicySpec.model_validate(spec)
    memory = PolicyMemory()
    with KubeApi.from_environment() as api:
        for _ in range(count):
            run_once(
                api, PolicyTick(PolicyRef(NS, "llama", "uid-llama"), parsed, time.time()), memory, metrics
            )
            time.sleep(0.2)


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(60)
async def test_kopf_records_its_action_in_the_served_metrics(
    kube: OptimisticEmulator, metrics_url: str, served: tuple[OperatorMetrics, str]
) -> None:
    metrics, url = served
    add_deployment(kube, ["--model", "/models/llama", "--max-num-seqs=64"])
    add_policy(kube, policy_spec(metrics_url, "Apply"))
    began = time.time()
    stop = asyncio.Event()
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    memo = kopf.Memo(operator_metrics=metrics)  # as `kvtune operator` hands it to kopf.run
    running = kopf.operator(standalone=True, namespaces=[NS], stop_flag=stop, settings=settings, memo=memo)
    operator = asyncio.create_task(running)
    try:
        deadline = time.monotonic() + 30
        while read_flag(container_args(kube), "--max-num-seqs") == 64 or not our_events(kube):
            assert time.monotonic() < deadline, "the operator did not act within 30 s"
            assert not operator.done(), operator
            await asyncio.sleep(0.2)
        series = await asyncio.to_thread(scrape, url)
        scraped_at = time.time()
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(operator, 15)

    lowered = read_flag(container_args(kube), "--max-num-seqs")
    assert lowered is not None and lowered < 64
    assert series_names(series) >= set(OPERATOR_SERIES), set(OPERATOR_SERIES) - series_names(series)
    policy = {"namespace": NS, "policy": "llama"}
    lower = {**policy, "remedy": "lower_max_num_seqs"}
    assert series_value(series, "kvtune_operator_actions_total", **lower, result="applied") == 1
    assert series_value(series, "kvtune_operator_actions_total", **lower, result="failed") == 0
    stamp = series_value(series, "kvtune_operator_last_action_timestamp_seconds", **lower)
    assert stamp is not None and began <= stamp <= scraped_at
    knob = "kvtune_operator_knob"
    assert series_value(series, knob, **policy, knob="max_num_seqs", kind="current") == lowered
    assert series_value(series, knob, **policy, knob="max_num_seqs", kind="recommended") == lowered
    assert series_value(series, knob, **policy, knob="max_tokens_cap", kind="current") == 0  # no cap
    assert series_value(series, "kvtune_operator_ladder_rung", **policy) == 2  # lower max_num_seqs
    assert series_value(series, "kvtune_operator_condition", **policy, type="Preempting") == 1
    assert series_value(series, "kvtune_operator_condition", **policy, type="Stable") == 0
    real = series_value(series, "kvtune_operator_concurrency_ceiling", **policy, kind="real")
    boot = series_value(series, "kvtune_operator_concurrency_ceiling", **policy, kind="boot_line")
    assert real is not None and real >= 1 and boot is not None and boot > 0
    evaluated = series_value(series, "kvtune_operator_last_evaluation_timestamp_seconds", **policy)
    assert evaluated is not None and stamp <= evaluated <= scraped_at  # the acting tick's, or a later one
    assert series_value(series, "kvtune_operator_no_data_total", **policy) == 0
    assert series_value(series, "kvtune_operator_rollbacks_total", **policy) == 0
    errors = [v for (name, _), v in series.items() if name == "kvtune_operator_errors_total"]
    assert errors and not any(errors)  # every kind declared, none met


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_unreachable_metrics_count_as_no_data_and_drop_the_knobs(
    kube: OptimisticEmulator, served: tuple[OperatorMetrics, str]
) -> None:
    metrics, url = served
    add_deployment(kube, ["--max-num-seqs", "64"])
    spec = policy_spec("http://127.0.0.1:9", "Apply")  # discard port: nothing listens
    add_policy(kube, spec)
    began = time.time()
    await asyncio.to_thread(ticks, spec, metrics, 3)
    series = await asyncio.to_thread(scrape, url)
    policy = {"namespace": NS, "policy": "llama"}
    assert series_value(series, "kvtune_operator_no_data_total", **policy) == 3
    evaluated = series_value(series, "kvtune_operator_last_evaluation_timestamp_seconds", **policy)
    assert evaluated is not None and evaluated >= began
    unknown = {"kvtune_operator_knob", "kvtune_operator_condition", "kvtune_operator_concurrency_ceiling"}
    assert not unknown & series_names(series)  # unknown, not a stale value
    assert series_value(series, "kvtune_operator_ladder_rung", **policy) == 0


@pytest.mark.asyncio
@pytest.mark.kmock(cls=OptimisticEmulator)
@pytest.mark.timeout(30)
async def test_a_missing_secret_and_an_unwritable_status_count_as_errors(
    kube: OptimisticEmulator, metrics_url: str, served: tuple[OperatorMetrics, str]
) -> None:
    """A kvtune target whose admin-token Secret does not exist: the operator cannot act (its changes become
    recommendations) and the policy object is gone, so its status cannot be written either."""
    metrics, url = served
    spec = {
        **policy_spec(metrics_url, "Apply"),
        "target": {
            "name": "llama",
            "engine": "kvtune",
            "adminUrl": metrics_url,
            "adminTokenSecretRef": {"name": "llama-admin", "key": "token"},
        },
    }
    await asyncio.to_thread(ticks, spec, metrics, 2)
    series = await asyncio.to_thread(scrape, url)
    policy = {"namespace": NS, "policy": "llama"}
    errors = "kvtune_operator_errors_total"
    assert series_value(series, errors, **policy, kind="actuator_unavailable") == 2
    assert series_value(series, errors, **policy, kind="status_write") == 2
    recommended = series_value(series, "kvtune_operator_actions_total", **policy,
                               remedy="lower_max_num_seqs", result="recommended")  # fmt: skip
    assert recommended == 1  # raised once, not on every tick
    current = series_value(series, "kvtune_operator_knob", **policy, knob="max_num_seqs", kind="current")
    advised = series_value(series, "kvtune_operator_knob", **policy, knob="max_num_seqs", kind="recommended")
    assert current == 64 and advised is not None and advised < 64
