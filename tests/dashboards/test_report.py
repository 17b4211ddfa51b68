"""`kvtune report` against a Prometheus stand-in on loopback that answers /api/v1/query_range: a PNG per
panel that decodes, with a legend per series, and an index.html that links every one."""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from matplotlib.image import imread

from kvtune.cli import main
from kvtune.dashboards import panels as p
from kvtune.dashboards.report import (
    Series,
    all_variables,
    file_name,
    legend_of,
    parse_duration,
    report,
)
from kvtune.errors import KvtuneError
from tests.stand_in_http import QuietHandler

END = 1_800_000_000.0
EMPTY_FAMILY = "capped_requests"  # the stand-in has no data for it: the panel says so instead of failing


class PrometheusStandIn:
    """Answers every range query with two series (pods a and b) whose values ramp across the window, and
    records the queries and the window it was asked for."""

    def __init__(self) -> None:
        self.queries: list[dict[str, str]] = []
        self.reject: str | None = None

    def answer(self, query: dict[str, str]) -> tuple[int, dict[str, object]]:
        self.queries.append(query)
        if self.reject:
            return 400, {"status": "error", "errorType": "bad_data", "error": self.reject}
        start, end, step = float(query["start"]), float(query["end"]), float(query["step"])
        if EMPTY_FAMILY in query["query"]:
            return 200, {"status": "success", "data": {"resultType": "matrix", "result": []}}
        level = 1 + sum(map(ord, query["query"])) % 7  # each query its own level, so the lines part
        result = []
        for index, pod in enumerate(("engine-a", "engine-b")):
            labels = {"pod": pod, "policy": f"ns/{pod}", "kind": "current", "reason": "varying_head"}
            times = [start + i * step for i in range(int((end - start) / step) + 1)]
            values = [[t, str((level + index) * (1.2 + math.sin(i / 20)) / 4)] for i, t in enumerate(times)]
            values.append([end, "NaN"])  # histogram_quantile of an idle window: drawn as a gap, not a point
            result.append({"metric": labels, "values": values})
        return 200, {"status": "success", "data": {"resultType": "matrix", "result": result}}


@pytest.fixture
def prometheus() -> Iterator[tuple[str, PrometheusStandIn]]:
    stand_in = PrometheusStandIn()

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path != "/api/v1/query_range":
                status, body = 404, {"status": "error", "error": f"no route {url.path}"}
            else:
                status, body = stand_in.answer({k: v[0] for k, v in parse_qs(url.query).items()})
            self.send_json(status, body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", stand_in
    server.shutdown()
    server.server_close()


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "img" and found.get("src"):
            self.images.append(str(found["src"]))
        if tag == "a" and found.get("href"):
            self.links.append(str(found["href"]))


def test_report_draws_every_panel_and_links_it(
    prometheus: tuple[str, PrometheusStandIn], tmp_path: Path
) -> None:
    url, stand_in = prometheus
    index = report(url, "30m", tmp_path / "out", end=END)

    asked = {q["query"] for q in stand_in.queries}
    assert asked == {all_variables(q.expr) for q in p.all_panel_queries()}
    assert not any("$" in query for query in asked)
    assert {(float(q["start"]), float(q["end"])) for q in stand_in.queries} == {(END - 1800, END)}
    assert {float(q["step"]) for q in stand_in.queries} == {8.0}  # 30m in at most 240 points

    pngs = sorted(path.name for path in index.parent.glob("*.png"))
    assert pngs == sorted(file_name(spec) for spec in p.all_panels())
    for name in pngs:
        image = imread(index.parent / name)
        assert image.shape[:2] == (450, 1100)
        assert image[..., :3].std() > 0.05  # something is drawn, not a blank canvas

    parser = Links()
    parser.feed(index.read_text())
    assert sorted(parser.images) == pngs
    assert sorted(parser.links) == pngs
    for spec in p.all_panels():
        assert spec.title.replace("&", "&amp;") in index.read_text()


def test_report_cli(
    prometheus: tuple[str, PrometheusStandIn], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = prometheus
    assert main(["report", "--prometheus", url, "--since", "1h", "--out", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / 'index.html'}" in capsys.readouterr().out
    assert len(list(tmp_path.glob("*.png"))) == len(p.all_panels())


def test_prometheus_errors_are_one_clear_line(
    prometheus: tuple[str, PrometheusStandIn], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, stand_in = prometheus
    stand_in.reject = "1:10: parse error: unexpected character"
    assert main(["report", "--prometheus", url, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Prometheus rejected" in err and "parse error" in err

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(KvtuneError, match=f"cannot reach Prometheus at http://127.0.0.1:{port}"):
        report(f"http://127.0.0.1:{port}", "1h", tmp_path)
    with pytest.raises(KvtuneError, match="not a Prometheus API"):
        report(url + "/not-prometheus", "1h", tmp_path)


@pytest.mark.parametrize("text", ["1x", "", "-5m", "0h", "h"])
def test_bad_since_is_refused(text: str) -> None:
    with pytest.raises(KvtuneError, match="not a duration"):
        parse_duration(text)


def test_durations_and_legends() -> None:
    assert [parse_duration(t) for t in ("45s", "30m", "1h", "2d", "1.5h")] == [45, 1800, 3600, 172800, 5400]
    assert legend_of("{{kind}} {{policy}}", {"kind": "real", "policy": "ns/p"}) == "real ns/p"
    assert legend_of("running {{pod}}", {}) == "running"
    assert legend_of("{{pod}}", {}) == "value"
    assert Series("a", p.SECONDS, [1.0], [2.0]).legend == "a"
