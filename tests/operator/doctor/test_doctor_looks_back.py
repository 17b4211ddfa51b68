"""`kvtune doctor` run after the incident: `--prometheus --since` reads range queries, and an engine that is
quiet now but preempted since boot is diagnosed from its counters since boot. On recorded scrapes, on a
stand-in Prometheus that answers range queries, and on a live `kvtune serve`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtune.cli import main
from kvtune.errors import KvtuneError
from kvtune.operator.doctor.command import parse_duration
from kvtune.operator.io.sources import MAX_RANGE_POINTS, PrometheusSource, range_step
from tests.operator.helpers import fixture_text, reply, serve_bodies

SINCE_BOOT_LINE = "the engine is quiet now; diagnosing from its counters since boot (30 minutes)"


def started(seconds_ago: float) -> str:
    """The process collector's start time, as kvtune serve and vLLM export it."""
    return (
        f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {time.time() - seconds_ago}\n"
    )


def quiet(preemptions: str | None = None, seconds_ago: float | None = 1800.0) -> str:
    """The recorded t1 scrape (95 preemptions since boot, nothing running or waiting) as a quiet engine
    shows it at every scrape, with its process start `seconds_ago` (none when None)."""
    text = fixture_text("kvtune_preempting_t1.prom")
    if preemptions is not None:
        text = text.replace('vllm:num_preemptions_total{engine="0",model_name="tiny"} 95.0',
                            f'vllm:num_preemptions_total{{engine="0",model_name="tiny"}} {preemptions}')  # fmt: skip
    return text + (started(seconds_ago) if seconds_ago is not None else "")


def doctor_json(args: list[str], capsys: pytest.CaptureFixture[str], code: int = 0) -> dict[str, Any]:
    assert main(["doctor", *args, "--json", "--window-seconds", "0.2"]) == code
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def remedy(data: dict[str, Any], name: str) -> dict[str, Any]:
    remedies = data["remedies"]
    assert isinstance(remedies, list)
    return next(r for r in remedies if r["remedy"] == name)


def test_quiet_engine_is_diagnosed_from_its_counters_since_boot(capsys: pytest.CaptureFixture[str]) -> None:
    for url in serve_bodies([quiet()]):
        data = doctor_json(["--metrics-url", url], capsys)
        assert data["basis"] == "since_boot" and data["status"] == "active"
        assert data["since_boot_seconds"] == pytest.approx(1800, abs=30)
        findings = data["findings"]
        assert isinstance(findings, dict)
        assert findings["preemptions"] == 95  # all since boot: the zero is at process start
        assert findings["preemption_rate"] == pytest.approx(95 / 1800, rel=0.02)
        assert findings["notes"][0]["code"] == "QuietSinceBoot"
        # the same ladder with numbers: all 80 finished requests' histograms (mean footprint 180, p95 290)
        lower = remedy(data, "lower_max_num_seqs")
        assert (lower["applicable"], lower["current"], lower["recommended"]) == (True, 64, 4)
        assert "4 x 180 (mean)" in str(lower["evidence"])
        assert "(80 requests, since engine start)" in str(remedy(data, "cap_max_tokens")["evidence"])
        assert main(["doctor", "--metrics-url", url, "--window-seconds", "0.2"]) == 0
        text = capsys.readouterr().out
        assert text.splitlines()[0].endswith("(quiet now; its counters since boot, 30 minutes)")
        assert SINCE_BOOT_LINE in text and "max_num_seqs: 64 → 4" in text
        # gauges are not read since boot: the evidence says n/a, never a made-up 0
        assert "running max n/a" in text and "running max 0" not in text


def test_quiet_engine_without_preemptions_since_boot_is_idle(capsys: pytest.CaptureFixture[str]) -> None:
    for url in serve_bodies([quiet(preemptions="0.0")]):
        data = doctor_json(["--metrics-url", url], capsys)
        assert (data["status"], data["basis"], data["since_boot_seconds"]) == ("idle", "window", None)
        assert not any(r["applicable"] for r in data["remedies"])
        assert [n["code"] for n in data["findings"]["notes"]] == ["Idle", "ConcurrencyCeiling"]


def test_quiet_engine_without_a_start_time_says_the_span_is_unknown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for url in serve_bodies([quiet(seconds_ago=None)]):
        data = doctor_json(["--metrics-url", url], capsys)
        assert (data["status"], data["basis"]) == ("idle", "window")
        notes = data["findings"]["notes"]
        assert notes[-1]["code"] == "QuietSinceBootUnknownSpan" and "95 preemptions" in notes[-1]["message"]
        assert not any(r["applicable"] for r in data["remedies"])


def test_a_busy_engine_is_diagnosed_over_the_window_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    boot = started(1800)  # one process: the same start time in both scrapes
    t0 = fixture_text("kvtune_preempting_t0.prom") + boot
    for url in serve_bodies([t0, quiet(seconds_ago=None) + boot]):
        data = doctor_json(["--metrics-url", url], capsys)
        assert data["basis"] == "window" and data["findings"]["preemptions"] == 49
        assert remedy(data, "lower_max_num_seqs")["recommended"] == 4


# ---- Prometheus range queries ------------------------------------------------------------------------------


def matrix(start: float, end: float, step: float) -> str:
    """A range answer from a stand-in that scraped the recorded t0 for the first half of the range and t1
    for the second: every series at every step, as Prometheus evaluates a range query."""
    halves = [
        list(text_string_to_metric_families(fixture_text(f"kvtune_preempting_{t}.prom")))
        for t in ("t0", "t1")
    ]
    stamps = [start + i * step for i in range(int((end - start) // step) + 1)]
    series: dict[tuple[tuple[str, str], ...], list[list[object]]] = {}
    for i, stamp in enumerate(stamps):
        for family in halves[0 if i < len(stamps) // 2 else 1]:
            for s in family.samples:
                key = tuple(sorted({"__name__": s.name, **s.labels}.items()))
                series.setdefault(key, []).append([stamp, repr(float(s.value))])
    result = [{"metric": dict(key), "values": values} for key, values in series.items()]
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}})


@pytest.fixture()
def prometheus() -> Iterator[tuple[str, list[dict[str, list[str]]]]]:
    """A stand-in Prometheus answering /api/v1/query_range from the request's own start, end and step;
    yields its URL and the query strings it was sent."""
    asked: list[dict[str, list[str]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            params = parse_qs(parts.query)
            asked.append(params)
            if parts.path != "/api/v1/query_range":
                reply(self, 404, "application/json", b'{"status": "error", "error": "not found"}')
                return
            start, end, step = (float(params[k][0]) for k in ("start", "end", "step"))
            reply(self, 200, "application/json", matrix(start, end, step).encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", asked
    server.shutdown()


def test_since_reads_the_last_hour_from_range_queries(
    prometheus: tuple[str, list[dict[str, list[str]]]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, asked = prometheus
    data = doctor_json(["--prometheus", url, "--selector", 'job="kvtune"', "--since", "1h"], capsys)
    (params,) = asked
    start, end, step = (float(params[k][0]) for k in ("start", "end", "step"))
    assert end - start == pytest.approx(3600) and step == 15.0  # 241 points per series
    assert params["query"][0].endswith(',job="kvtune"}')
    assert data["basis"] == "range" and data["source"] == f'{url} job="kvtune" (last 1h)'
    findings = data["findings"]
    assert isinstance(findings, dict)
    assert findings["samples"] == 241 and findings["window_seconds"] == pytest.approx(3600)
    assert findings["preemptions"] == 49  # t0 -> t1 within the hour
    assert findings["preemption_rate"] == pytest.approx(49 / 3600)
    lower = remedy(data, "lower_max_num_seqs")
    assert (lower["applicable"], lower["current"], lower["recommended"]) == (True, 64, 4)
    assert main(["doctor", "--prometheus", url, "--selector", "job=x", "--since", "1h"]) == 0
    assert "(241 samples over 3600 s, from range queries)" in capsys.readouterr().out.splitlines()[0]


def test_range_query_failures_are_no_data(capsys: pytest.CaptureFixture[str]) -> None:
    answers = [
        '{"status": "error", "errorType": "bad_data", "error": "parse error"}',
        json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}}),
    ]
    for body, reason in zip(
        answers, ("parse error", "no series match the selector in the last 600 s"), strict=True
    ):
        for url in serve_bodies([body]):  # answers every path, /api/v1/query_range included
            data = doctor_json(["--prometheus", url, "--selector", "job=x", "--since", "10m"], capsys, code=1)
            assert data["status"] == "no_data" and reason in data["findings"]["notes"][0]["message"]


def test_range_step_keeps_a_few_hundred_points() -> None:
    assert range_step(60) == 1.0 and range_step(3600) == 15.0
    for seconds in (1, 59, 600, 3600, 86_400, 7 * 86_400):
        assert seconds / range_step(seconds) <= MAX_RANGE_POINTS
    assert PrometheusSource("http://p", "").read_range(1).reason.startswith("unreachable")


def test_durations() -> None:
    assert parse_duration("1h") == 3600 and parse_duration("1h30m") == 5400
    assert parse_duration("90") == 90 and parse_duration("2d") == 172_800 and parse_duration("1.5m") == 90
    for bad in ("0s", "-5", "h", "1x", "", "inf", "nan"):
        with pytest.raises(KvtuneError):
            parse_duration(bad)


def test_since_needs_prometheus_and_a_duration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--metrics-url", "http://127.0.0.1:9", "--since", "1h"]) == 2
    assert "--since needs --prometheus" in capsys.readouterr().err
    assert main(["doctor", "--prometheus", "http://127.0.0.1:9", "--selector", "j=x", "--since", "soon"]) == 2
    assert "'soon' is not a duration" in capsys.readouterr().err
