"""`kvtune operator --local --metrics-port P` against a real engine: `kvtune serve` (tiny model, a 1,024-token
pool, max_num_seqs 64) preempting under 16 clients. Its /metrics shows the action as soon as the operator
takes it, with every series of the contract, labelled namespace "local" and the target's host:port; when the
engine goes down, no-data counts and the knobs drop out while evaluations go on. A refused change (a wrong
admin token) is a failed action and an apply error."""

from __future__ import annotations

import socket
import subprocess
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from kvtune.cli import main
from kvtune.harness.engine_process import start_engine, write_tiny_model_in_subprocess
from kvtune.harness.load import BackgroundLoad, LoadShape
from kvtune.harness.local_http import free_port
from kvtune.harness.server import ServerProcess, cli_argv
from kvtune.operator.decide.loop import step, window_length
from kvtune.operator.decide.policy import Mode, TuningPolicy
from kvtune.operator.decide.sample import Sample
from kvtune.operator.decide.tuner import TunerState
from kvtune.operator.io.actuators import KvtuneAdminActuator
from kvtune.operator.io.local_metrics import LocalRecorder, local_policy_name
from kvtune.operator.io.own_metrics import OperatorMetrics
from kvtune.operator.io.sources import MetricsEndpoint
from tests.operator.helpers import (
    OPERATOR_SERIES,
    Series,
    fixture_text,
    metrics_answer,
    parse_series,
    series_names,
    series_value,
    serve_routes,
)

TOKEN = "own-metrics-token"
INTERVAL = 0.5
# The operator process ticks this often, so the acting tick's figures stay on its /metrics for 2 s: the next
# tick replaces them (while it judges the change it may know no condition), and a scrape every 50 ms must
# land before it; at 0.5 s a busy machine's scrape sometimes came a tick late.
OPERATOR_INTERVAL = 2.0
POLL_S = 0.05


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[ServerProcess]:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    model = write_tiny_model_in_subprocess(tmp_path / "tiny")
    live = start_engine(
        model, token, tmp_path / "engine.log", "--kv-cache-tokens", "1024", "--max-num-seqs", "64"
    )
    yield live
    live.stop()


def scrape(url: str) -> Series | None:
    try:
        response = httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None  # the operator is still starting
    return parse_series(response.text) if response.status_code == 200 else None


def wait_for_series(url: str, ready: str, seconds: float, at_least: float = 1, **labels: str) -> Series:
    """Scrape until the sample `ready` with `labels` is at least `at_least`; returns that scrape."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        series = scrape(url)
        if series is not None and (series_value(series, ready, **labels) or 0) >= at_least:
            return series
        time.sleep(POLL_S)
    raise AssertionError(f"{ready}{labels} did not reach {at_least} within {seconds:.0f} s: {series}")


def test_local_operator_serves_its_action_and_counts_the_outage(
    engine: ServerProcess, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    log = tmp_path / "operator.log"
    command = cli_argv("operator", "--local", "--target", engine.url, "--admin-token-file",
                             str(tmp_path / "token"), "--interval", str(OPERATOR_INTERVAL), "--evaluation-window", "2",
                             "--metrics-port", str(port), "--no-predict")  # fmt: skip
    # --no-predict: this test follows the ladder's lower_max_num_seqs (the predicted move has its own below)
    began = time.time()
    with log.open("wb") as out:
        operator = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    load = BackgroundLoad(engine.url, LoadShape(clients=16)).start()
    policy = {"namespace": "local", "policy": local_policy_name(engine.url)}
    lower = {**policy, "remedy": "lower_max_num_seqs"}
    try:
        # deadlines that only catch a hang: the action shows within ~10 s, the outage within ~2 s
        acted = wait_for_series(url, "kvtune_operator_actions_total", 120, **lower, result="applied")
        scraped_at = time.time()
        # the real ceiling needs requests that finished in the window, which the first action need not have
        # waited for (it acts on preemptions): a later evaluation under the same load shows it
        measured = wait_for_series(url, "kvtune_operator_concurrency_ceiling", 120, **policy, kind="real")
        load.stop()
        stopping = time.time()
        engine.stop()
        down = wait_for_series(url, "kvtune_operator_no_data_total", 60, at_least=3, **policy)
    finally:
        load.stop()
        operator.terminate()
        operator.wait(15)
    output = log.read_text()
    assert "Traceback" not in output, output[-2000:]

    stamp = series_value(acted, "kvtune_operator_last_action_timestamp_seconds", **lower)
    assert stamp is not None and began <= stamp <= scraped_at
    evaluated = series_value(acted, "kvtune_operator_last_evaluation_timestamp_seconds", **policy)
    assert evaluated == stamp, "the scrape came after the tick that acted: its figures were replaced"
    assert series_names(acted) >= set(OPERATOR_SERIES), set(OPERATOR_SERIES) - series_names(acted)
    assert policy["policy"] == f"127.0.0.1:{engine.url.rsplit(':', 1)[1]}"
    current = series_value(acted, "kvtune_operator_knob", **policy, knob="max_num_seqs", kind="current")
    assert current is not None and current < 64, current
    assert (
        series_value(acted, "kvtune_operator_knob", **policy, knob="max_num_seqs", kind="recommended")
        == current
    )
    assert series_value(acted, "kvtune_operator_ladder_rung", **policy) == 2
    assert series_value(acted, "kvtune_operator_condition", **policy, type="Preempting") == 1
    real = series_value(measured, "kvtune_operator_concurrency_ceiling", **policy, kind="real")
    assert real is not None and 1 <= real < 64

    assert not {"kvtune_operator_knob", "kvtune_operator_condition"} & series_names(down)  # unknown now
    after = series_value(down, "kvtune_operator_last_evaluation_timestamp_seconds", **policy)
    assert after is not None and after > stopping  # it goes on evaluating
    assert (series_value(down, "kvtune_operator_actions_total", **lower, result="applied") or 0) >= 1


def test_the_local_operator_predicts_and_serves_the_forecast_beside_the_observed_rate(
    engine: ServerProcess, tmp_path: Path
) -> None:
    """Issue 28, the whole chain on a real engine: the fit of the live window, the what-if forecast for
    max_num_seqs (a predicted move, or the value the ladder reached when that is already the pick; while
    the young engine has finished too few requests to fit, the ladder steps), and the operator's /metrics
    with the objective in force and the predicted rate at the value in force beside the observed one."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    log = tmp_path / "operator.log"
    command = cli_argv("operator", "--local", "--target", engine.url, "--admin-token-file",
                             str(tmp_path / "token"), "--interval", str(INTERVAL), "--evaluation-window", "2",
                             "--metrics-port", str(port))  # fmt: skip
    with log.open("wb") as out:
        operator = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    load = BackgroundLoad(engine.url, LoadShape(clients=16)).start()
    policy = {"namespace": "local", "policy": local_policy_name(engine.url)}
    predicted: Series | None = None
    try:
        deadline = time.monotonic() + 180
        while predicted is None:
            assert time.monotonic() < deadline, f"no forecast within 180 s: {log.read_text()[-2000:]}"
            series = scrape(url)
            # the tick right after the move has no window at the new value yet (observed unknown): wait for
            # the one that has both
            if series is not None and all(
                series_value(series, "kvtune_operator_preemptions_per_minute", **policy, kind=kind)
                is not None
                for kind in ("predicted", "observed")
            ):
                predicted = series
            time.sleep(INTERVAL / 2)
    finally:
        load.stop()
        operator.terminate()
        operator.wait(15)
    output = log.read_text()
    assert "Traceback" not in output, output[-2000:]
    assert series_value(predicted, "kvtune_operator_preemptions_per_minute", **policy, kind="predicted") == 0
    assert (
        series_value(predicted, "kvtune_operator_preemptions_per_minute", **policy, kind="observed")
        is not None
    )
    current = series_value(predicted, "kvtune_operator_knob", **policy, knob="max_num_seqs", kind="current")
    assert current is not None and current < 64, current
    assert series_value(predicted, "kvtune_operator_objective", **policy, objective="NoPreemption") == 1
    assert series_value(predicted, "kvtune_operator_objective", **policy, objective="Goodput") is None
    misses = series_value(predicted, "kvtune_operator_prediction_misses", **policy)
    assert misses is not None and misses < 2


def test_a_refused_change_is_a_failed_action_and_an_apply_error() -> None:
    """An engine stand-in whose admin API refuses the token: the tuner's change is counted as failed (and
    tried again after the cooldown, so as often as the apply errors), never as applied."""
    policy = TuningPolicy(mode=Mode.APPLY, evaluation_window_s=1.0, cooldown_s=0.0)
    refused = (401, "application/json", '{"error": {"message": "bad token"}}')
    metrics = [metrics_answer(fixture_text(f"kvtune_preempting_{t}.prom")) for t in ("t0", "t1")]
    for base in serve_routes({"/metrics": metrics, "/admin/config": [refused]}):
        recorder = LocalRecorder(OperatorMetrics(), base, policy)
        source, actuator = MetricsEndpoint(base), KvtuneAdminActuator(base, "wrong-token")
        state, samples = TunerState(), deque[Sample](maxlen=window_length(policy, INTERVAL))
        for _ in range(3):
            tick = step(source, actuator, policy, state, samples, time.time())
            recorder(tick)
            state = tick.state
            time.sleep(0.1)
        series = parse_series(generate_latest(recorder.metrics.registry).decode())
    labels = {"namespace": "local", "policy": local_policy_name(base)}
    failed = series_value(series, "kvtune_operator_actions_total", **labels, remedy="lower_max_num_seqs",
                          result="failed")  # fmt: skip
    assert failed is not None and failed >= 1
    assert series_value(series, "kvtune_operator_errors_total", **labels, kind="apply") == failed
    applied = [v for (name, have), v in series.items()
               if name == "kvtune_operator_actions_total" and ("result", "applied") in have]  # fmt: skip
    assert applied and not any(applied)
    assert series_value(series, "kvtune_operator_no_data_total", **labels) == 0


@pytest.mark.parametrize("port", ["70000", "-1", "busy"])
def test_a_bad_metrics_port_is_one_clear_line(
    port: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        chosen = str(taken.getsockname()[1]) if port == "busy" else port
        args = ["operator", "--local", "--target", "http://127.0.0.1:9", "--admin-token-file", str(token),
                "--metrics-port", chosen]  # fmt: skip
        assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvtune: error: --metrics-port {chosen}"), err
