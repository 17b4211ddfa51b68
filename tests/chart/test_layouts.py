"""Each layout's values (deploy/layouts/, docs/install.md "Layouts") render the PodMonitor and rules that
layout needs; the engine selector reaches every raw engine series and nothing else; the examples land where
the operator looks. Every layout is also in the render matrix (CRDs, promtool)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvtune.observability import rules
from tests.chart.helm import MONITORING_API, by_kind, one, render, template
from tests.chart.matrix import ENGINE_ON, LAYOUTS, VLLM_PROXY_ON, layout

# a raw engine series: any spelling of an engine's name, not a recorded kvtune_engine: one
RAW_SERIES = re.compile(r"\b(?:kserve_)?(?:vllm|sglang|kvtune)(?!_engine:)[:_][a-zA-Z0-9_:]+(?=[{\[\s)]|$)")


def engine_endpoint(objects: list[dict[str, Any]]) -> dict[str, Any]:
    endpoint: dict[str, Any] = one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    return endpoint


def recording_exprs(objects: list[dict[str, Any]]) -> list[str]:
    groups = one(objects, "PrometheusRule")["spec"]["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"] if "record" in rule]


@pytest.mark.parametrize(
    ("name", "port", "scheme", "tls"),
    [
        ("vllm", {"port": "http"}, "http", None),
        ("production-stack", {"port": "container-port"}, "http", None),
        ("kserve", {"targetPort": 8000}, "https", {"insecureSkipVerify": True}),
        ("llm-d", {"port": "metrics"}, "http", None),
        ("kvtune-engine", {"port": "http"}, "http", None),
    ],
)
def test_each_layout_scrapes_its_engines_port(
    name: str, port: dict[str, Any], scheme: str, tls: dict[str, Any] | None, tmp_path: Path
) -> None:
    assert name in LAYOUTS
    endpoint = engine_endpoint(render(layout(name), tmp_path, (MONITORING_API,)))
    assert {key: endpoint[key] for key in ("port", "targetPort") if key in endpoint} == port
    assert endpoint["scheme"] == scheme and endpoint.get("tlsConfig") == tls


def test_the_proxy_endpoint_stays_plain_http_beside_an_https_engine(tmp_path: Path) -> None:
    values = layout("kserve")
    values["monitoring"]["podMonitor"]["proxyPort"] = "proxy"  # type: ignore[index]
    engine, proxy = one(render(values, tmp_path, (MONITORING_API,)), "PodMonitor")["spec"][
        "podMetricsEndpoints"
    ]
    assert engine["scheme"] == "https" and (proxy["port"], "scheme" in proxy, "tlsConfig" in proxy) == (
        "proxy",
        False,
        False,
    )


def test_the_engine_selector_reaches_every_raw_engine_series_and_only_them(tmp_path: Path) -> None:
    default = recording_exprs(render({}, tmp_path, (MONITORING_API,)))
    assert rules.ENGINE_SELECTOR == '{server=""}'
    chosen = ['container="vllm"', 'job=~".+/kvtune-engines"']
    exprs = recording_exprs(
        render({"monitoring": {"prometheusRule": {"engineSelector": chosen}}}, tmp_path, (MONITORING_API,))
    )
    block = '{container="vllm", job=~".+/kvtune-engines"}'
    for before, after in zip(default, exprs, strict=True):
        assert after == before.replace(rules.ENGINE_SELECTOR, block)
        names = RAW_SERIES.findall(after)
        assert names and after.count(block) == len(names), after
        assert rules.ENGINE_SELECTOR not in after
    alerts = [r["expr"] for g in one(render({}, tmp_path, (MONITORING_API,)), "PrometheusRule")["spec"]["groups"]
              for r in g["rules"] if "alert" in r]  # fmt: skip
    assert not any("{" in expr and "server" in expr for expr in alerts)  # alerts read only recorded series


def test_an_empty_engine_selector_takes_every_series(tmp_path: Path) -> None:
    exprs = recording_exprs(
        render({"monitoring": {"prometheusRule": {"engineSelector": []}}}, tmp_path, (MONITORING_API,))
    )
    assert all("server" not in expr for expr in exprs) and "vllm:num_requests_running{}" in "".join(exprs)


@pytest.mark.parametrize("bad", ["server", '{server=""}', 'a="x",b="y"'])
def test_a_malformed_matcher_is_refused_by_the_schema(bad: str, tmp_path: Path) -> None:
    done = template({"monitoring": {"prometheusRule": {"engineSelector": [bad]}}}, tmp_path)
    assert done.returncode != 0 and "engineSelector" in done.stderr


def test_the_examples_render_into_the_first_watched_namespace(tmp_path: Path) -> None:
    examples = {"examples": {**ENGINE_ON["examples"], **VLLM_PROXY_ON["examples"]}}
    objects = render({**examples, "watchNamespaces": ["inference", "batch"]}, tmp_path)
    mine = [o for o in objects if o["metadata"]["name"].startswith("kvtune-example-")]
    assert {o["kind"] for o in mine} == {"Secret", "Deployment", "Service", "KVTuningPolicy"}
    assert {o["metadata"]["namespace"] for o in mine} == {"inference"}
    secrets = {o["metadata"]["name"] for o in mine if o["kind"] == "Secret"}
    for role in by_kind(objects, "Role"):  # the operator may read them where they are (and only by name)
        granted = [r for r in role["rules"] if r.get("resources") == ["secrets"]]
        assert set(granted[0]["resourceNames"]) >= secrets, role["metadata"]["namespace"]
    wide = render({**examples, "clusterWide": True}, tmp_path)
    assert {
        o["metadata"]["namespace"] for o in wide if o["metadata"]["name"].startswith("kvtune-example-")
    } == {"kvtune-system"}
