"""The in-cluster operator's own /metrics, against kmock's Kubernetes API and real HTTP metrics: kopf runs the
handlers with the served registry in its memo (as `kvtune operator --metrics-port` wires it), and a scrape
shows the action (counter, timestamp), the knobs current and recommended, the rung, the conditions, the
ceilings and a recent evaluation; unreachable metrics, a missing admin Secret and an unwritable status are
counted as no-data and errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import kopf
import pytest

import kvtune.operator.k8s.handlers  # noqa: F401  (registers the handlers with kopf)
from kvtune.operator.io.own_metrics import OperatorMetrics
from kvtune.operator.k8s.reconcile import PolicyMemory
from kvtune.operator.k8s.workload_actuator import read_flag
from tests.operator.helpers import OPERATOR_SERIES, Series, parse_series, series_names, series_value
from tests.operator.kmock_world import (
    LLAMA_ARGS,
    NS,
    OptimisticEmulator,
    add_deployment_and_policy,
    container_args,
    kopf_running,
    kvtune_admin_spec,
    our_events,
    policy_spec,
    ticks,
)

pytestmark = pytest.mark.asyncio


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


@pytest.mark.timeout(60)
async def test_kopf_records_its_action_in_the_served_metrics(
    kube: OptimisticEmulator, metrics_url: str, served: tuple[OperatorMetrics, str]
) -> None:
    metrics, url = served
    add_deployment_and_policy(kube, LLAMA_ARGS, policy_spec(metrics_url, "Apply"))
    began = time.time()
    async with kopf_running(kopf.Memo(operator_metrics=metrics)) as operator:  # as `kvtune operator` hands it
        await operator.until(lambda: read_flag(container_args(kube), "--max-num-seqs") != 64 and our_events(kube),
                             30, "the operator did not act within 30 s")  # fmt: skip
        series = await asyncio.to_thread(scrape, url)
        scraped_at = time.time()

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


@pytest.mark.timeout(30)
async def test_unreachable_metrics_count_as_no_data_and_drop_the_knobs(
    kube: OptimisticEmulator, served: tuple[OperatorMetrics, str]
) -> None:
    metrics, url = served
    spec = add_deployment_and_policy(
        kube, ["--max-num-seqs", "64"], policy_spec("http://127.0.0.1:9", "Apply")
    )  # discard port: nothing listens
    began = time.time()
    await ticks(spec, PolicyMemory(), 3, metrics=metrics, pause=0.2)
    series = await asyncio.to_thread(scrape, url)
    policy = {"namespace": NS, "policy": "llama"}
    assert series_value(series, "kvtune_operator_no_data_total", **policy) == 3
    evaluated = series_value(series, "kvtune_operator_last_evaluation_timestamp_seconds", **policy)
    assert evaluated is not None and evaluated >= began
    unknown = {"kvtune_operator_knob", "kvtune_operator_condition", "kvtune_operator_concurrency_ceiling"}
    assert not unknown & series_names(series)  # unknown, not a stale value
    assert series_value(series, "kvtune_operator_ladder_rung", **policy) == 0


@pytest.mark.timeout(30)
async def test_a_missing_secret_and_an_unwritable_status_count_as_errors(
    kube: OptimisticEmulator, metrics_url: str, served: tuple[OperatorMetrics, str]
) -> None:
    """A kvtune target whose admin-token Secret does not exist: the operator cannot act (its changes become
    recommendations) and the policy object is gone, so its status cannot be written either."""
    metrics, url = served
    await ticks(kvtune_admin_spec(metrics_url, "Apply"), PolicyMemory(), 2, metrics=metrics, pause=0.2)
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
