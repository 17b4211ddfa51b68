"""The committed dashboards/*.json: no drift from the Python source, and the structure Grafana's conventions
ask for (unique ids, the datasource variable everywhere, units, variables, every query filtered on them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtune.cli import main
from kvtune.dashboards import panels as p
from kvtune.dashboards.build import REBUILD_COMMAND, drift, rendered
from kvtune.dashboards.command import CHART_COPY_DIR
from kvtune.dashboards.report import all_variables
from kvtune.observability.rules import alert_rules

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "dashboards"
CHART_COPY = REPO / CHART_COPY_DIR
UIDS = (p.KV_CACHE_UID, p.OPERATOR_UID, p.LATENCY_UID)
ENGINE_MATCHERS = ('namespace=~"$namespace"', 'model_name=~"$model"', 'pod=~"$pod"')
OPERATOR_MATCHERS = ('namespace=~"$namespace"', 'policy=~"$policy"')
# A metric name followed by its label matchers, or standing bare.
SELECTOR = re.compile(r"(kvtune_engine:[a-z0-9_:]+|kvtune_operator_[a-z_]+)(\{[^}]*\})?")


def committed(uid: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((COMMITTED / f"{uid}.json").read_text())
    return loaded


def graph_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def test_committed_dashboards_match_the_source() -> None:
    stale = drift(COMMITTED)
    assert not stale, f"dashboards/ is stale ({', '.join(stale)}): run `{REBUILD_COMMAND}` and commit"
    assert sorted(path.name for path in COMMITTED.glob("*.json")) == sorted(rendered())


def test_the_charts_copy_matches_the_source() -> None:
    stale = drift(CHART_COPY)
    assert not stale, f"{CHART_COPY_DIR}/ is stale ({', '.join(stale)}): run `{REBUILD_COMMAND}` and commit"
    assert sorted(path.name for path in CHART_COPY.glob("*.json")) == sorted(rendered())


def test_build_command_writes_the_same_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, chart = tmp_path / "dashboards", tmp_path / "chart"
    assert main(["dashboards", "build", "--out", str(out), "--chart-out", str(chart)]) == 0
    for folder in (out, chart):
        assert sorted(path.name for path in folder.iterdir()) == [f"{uid}.json" for uid in sorted(UIDS)]
        for uid in UIDS:
            assert (folder / f"{uid}.json").read_text() == (COMMITTED / f"{uid}.json").read_text()
    assert capsys.readouterr().out.count("wrote ") == 6


def test_drift_is_detected_and_names_the_file(tmp_path: Path) -> None:
    main(["dashboards", "build", "--out", str(tmp_path), "--chart-out", str(tmp_path / "chart")])
    edited = tmp_path / f"{p.LATENCY_UID}.json"
    edited.write_text(edited.read_text().replace('"unit": "s"', '"unit": "ms"', 1))
    assert drift(tmp_path) == [f"{p.LATENCY_UID}.json"]


@pytest.mark.parametrize("uid", UIDS)
def test_identity_and_schema_version(uid: str) -> None:
    dashboard = committed(uid)
    assert dashboard["uid"] == uid
    assert dashboard["schemaVersion"] == 41  # the SDK's Grafana 11.6 build, as pinned
    assert "id" not in dashboard or dashboard["id"] is None


@pytest.mark.parametrize("uid", UIDS)
def test_panel_ids_are_unique(uid: str) -> None:
    ids = [panel["id"] for panel in committed(uid)["panels"]]
    assert len(ids) == len(set(ids)), ids
    assert all(isinstance(i, int) and i > 0 for i in ids)


@pytest.mark.parametrize("uid", UIDS)
def test_no_hard_coded_datasource_uid(uid: str) -> None:
    dashboard = committed(uid)
    refs = [panel["datasource"] for panel in graph_panels(dashboard)]
    refs += [target["datasource"] for panel in graph_panels(dashboard) for target in panel["targets"]]
    refs += [a["datasource"] for a in dashboard["annotations"]["list"]]
    refs += [v["datasource"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert refs and all(ref == {"type": "prometheus", "uid": "${datasource}"} for ref in refs)
    text = (COMMITTED / f"{uid}.json").read_text()
    assert set(re.findall(r'"uid": "([^"]*)"', text)) == {"${datasource}", uid}


@pytest.mark.parametrize("uid", UIDS)
def test_every_panel_has_a_unit_a_description_and_a_legend(uid: str) -> None:
    for panel in graph_panels(committed(uid)):
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert "Healthy" in panel["description"], panel["title"]
        assert panel["options"]["legend"]["showLegend"] is True, panel["title"]
        assert all(target["legendFormat"] and target["refId"] for target in panel["targets"])
        for override in panel["fieldConfig"]["overrides"]:  # a second quantity has its own unit
            assert "unit" in [prop["id"] for prop in override["properties"]]


@pytest.mark.parametrize("uid", UIDS)
def test_variables_are_present_and_every_used_one_is_defined(uid: str) -> None:
    dashboard = committed(uid)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "model", "pod"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in set(variables) - {"datasource"}:
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    exprs = [t["expr"] for panel in graph_panels(dashboard) for t in panel["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    exprs += [v["query"] for v in variables.values() if v["type"] == "query"]
    used = {name for expr in exprs for name in re.findall(r"\$([a-z_]+)", expr) if not name.startswith("__")}
    assert used <= set(variables), used - set(variables)


@pytest.mark.parametrize("uid", UIDS)
def test_every_query_filters_on_the_variables(uid: str) -> None:
    dashboard = committed(uid)
    exprs = [t["expr"] for panel in graph_panels(dashboard) for t in panel["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    for expr in exprs:
        selectors = SELECTOR.findall(expr)
        assert selectors, expr
        for name, matchers in selectors:
            wanted = ENGINE_MATCHERS if name.startswith("kvtune_engine:") else OPERATOR_MATCHERS
            assert all(m in matchers for m in wanted), f"{name}{matchers} in {expr}"


def test_the_panels_the_issue_names_are_there() -> None:
    titles = {uid: {panel["title"] for panel in graph_panels(committed(uid))} for uid in UIDS}
    exprs = " ".join(q.expr for q in p.all_panel_queries())
    for needed in (
        "kv_usage:ratio",
        "preemptions:rate5m",
        "preemptions:total",
        "kv_effective:ratio",
        'kind="real"',
        'kind="boot_line"',
        "max_num_seqs",
        "requests_waiting",
        "prefix_hit:ratio",
        "prefix_defeats:rate5m",
        "prompt_tokens_bucket",
        "max_tokens_bucket",
        "capped_requests:rate5m",
        "kvtune_operator_actions_total",
        "kvtune_operator_knob",
        "kvtune_operator_ladder_rung",
        "kvtune_operator_condition",
        "kvtune_operator_rollbacks_total",
        "kvtune_operator_preemptions_per_minute",  # issue 28: predicted against observed
        "kvtune_operator_objective",
    ):
        assert needed in exprs, needed
    assert len(titles[p.KV_CACHE_UID]) >= 10
    latency = graph_panels(committed(p.LATENCY_UID))
    for family in ("ttft", "itl", "e2e", "queue"):
        panel = next(
            x for x in latency if any(f":{family}_seconds_bucket" in t["expr"] for t in x["targets"])
        )
        assert any("preemptions:rate5m" in t["expr"] for t in panel["targets"]), panel["title"]
    annotations = {a["name"] for a in committed(p.OPERATOR_UID)["annotations"]["list"]}
    assert "Operator actions" in annotations


def test_all_panel_queries_is_what_the_dashboards_hold() -> None:
    from_json = {
        (uid, panel["title"], target["expr"])
        for uid in UIDS
        for panel in graph_panels(committed(uid))
        for target in panel["targets"]
    }
    from_source = {(q.dashboard_uid, q.panel_title, q.expr) for q in p.all_panel_queries()}
    assert from_json == from_source
    assert all(q.unit for q in p.all_panel_queries())


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """Each panel and annotation query as a recording rule, checked by promtool: a syntax error fails here
    rather than in someone's Grafana."""
    promtool = shutil.which("promtool")
    if promtool is None:
        message = "promtool (Debian package prometheus) is not installed; `make test` installs it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    exprs = [q.expr for q in p.all_panel_queries()] + [p.PREEMPTION_ANNOTATION, p.ACTION_ANNOTATION]
    rules = [{"record": f"kvtune_panel:query_{i}", "expr": all_variables(e)} for i, e in enumerate(exprs)]
    path = tmp_path / "panels.rules.json"  # JSON is YAML, so promtool reads it
    path.write_text(json.dumps({"groups": [{"name": "panels", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


@pytest.mark.parametrize("uid", UIDS)
def test_the_sdk_decodes_the_committed_json_into_its_typed_models(uid: str) -> None:
    """No Grafana installs here: the SDK's own decoder is the closest reader. Every panel comes back as a
    typed timeseries panel with Prometheus queries, and re-encoding loses nothing (it only adds the empty
    `custom` block the decoder creates)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard as DashboardModel
    from grafana_foundation_sdk.models.prometheus import Dataquery
    from grafana_foundation_sdk.models.timeseries import Options

    register_default_plugins()
    original = committed(uid)
    decoded = DashboardModel.from_json(original)
    graphs = [panel for panel in decoded.panels or [] if getattr(panel, "type_val", None) == "timeseries"]
    assert len(graphs) == len(graph_panels(original))
    for panel in graphs:
        assert isinstance(panel.options, Options)
        assert panel.targets and all(isinstance(target, Dataquery) for target in panel.targets)
    again = json.loads(JSONEncoder(sort_keys=True).encode(decoded))
    for panel, before in zip(graph_panels(again), graph_panels(original), strict=True):
        defaults, expected = panel["fieldConfig"]["defaults"], before["fieldConfig"]["defaults"]
        assert defaults["custom"] == expected.get("custom", {})
        if "custom" not in expected:
            del defaults["custom"]
    assert again == original


# Grafana's unit ids the panels use; anything else must be a custom `suffix:` unit with its word.
GRAFANA_UNITS = {"percentunit", "s", "reqps", "short"}


def _known_unit(unit: object) -> bool:
    return unit in GRAFANA_UNITS or (isinstance(unit, str) and bool(re.fullmatch(r"suffix: \S.*", unit)))


@pytest.mark.parametrize("uid", UIDS)
def test_every_panel_and_every_second_axis_has_a_known_unit(uid: str) -> None:
    for panel in graph_panels(committed(uid)):
        assert _known_unit(panel["fieldConfig"]["defaults"].get("unit")), panel["title"]
        for override in panel["fieldConfig"]["overrides"]:
            units = [prop["value"] for prop in override["properties"] if prop["id"] == "unit"]
            assert units and all(_known_unit(unit) for unit in units), panel["title"]


def _panel(uid: str, title: str) -> dict[str, Any]:
    (found,) = [panel for panel in graph_panels(committed(uid)) if panel["title"] == title]
    return found


def _steps(panel: dict[str, Any]) -> list[tuple[float | None, str]]:
    thresholds = panel["fieldConfig"]["defaults"]["thresholds"]
    assert thresholds["mode"] == "absolute", panel["title"]
    return [(step["value"], step["color"]) for step in thresholds["steps"]]


ONE_EVENT_IN_A_5M_RATE = 1 / 300


def test_any_preemption_is_red() -> None:
    """The design's rule (any preemption is the alert) on every preemption-rate panel: one preemption in the
    5-minute rate already crosses into red, and each line turns red itself (colour by threshold)."""
    for title in ("Preemptions per second", "Requests preempted more than once", "Preemptions by reason"):
        panel = _panel(p.KV_CACHE_UID, title)
        (base, (red_from, red)) = _steps(panel)
        assert base == (None, "green") and red == "red", title
        assert 0 < red_from <= ONE_EVENT_IN_A_5M_RATE, title
        assert panel["fieldConfig"]["defaults"]["color"] == {"mode": "thresholds"}, title
        assert panel["fieldConfig"]["defaults"]["custom"]["gradientMode"] == "scheme", title


def test_kv_usage_near_the_pool_is_banded_orange_then_red() -> None:
    panel = _panel(p.KV_CACHE_UID, "KV cache usage")
    assert _steps(panel) == [(None, "transparent"), (0.9, "orange"), (0.98, "red")]
    assert panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"
    assert panel["fieldConfig"]["defaults"]["max"] == 1  # the pool: the bands sit where full is
    # KVCacheSaturated's usage sits in the orange band: with requests waiting for 10 minutes it is a ticket
    (saturated,) = [a for a in alert_rules() if a.alert == "KVCacheSaturated"]
    usage = float(re.findall(r"kv_usage:ratio > ([0-9.]+)", saturated.expr)[0])
    assert 0.9 <= usage < 0.98


def test_cap_hits_errors_defeats_and_rollbacks_turn_orange_from_the_first() -> None:
    for uid, title in (
        (p.KV_CACHE_UID, "Capped requests"),
        (p.KV_CACHE_UID, "Prefix-cache defeats by reason"),
        (p.OPERATOR_UID, "Errors and no-data per second"),
        (p.OPERATOR_UID, "Rollbacks in each interval"),
    ):
        panel = _panel(uid, title)
        (base, (orange_from, orange)) = _steps(panel)
        assert base == (None, "green") and orange == "orange", title
        assert 0 < orange_from <= ONE_EVENT_IN_A_5M_RATE, title
        assert panel["fieldConfig"]["defaults"]["color"] == {"mode": "thresholds"}, title


def test_panels_with_thresholds_show_them() -> None:
    """A threshold Grafana never draws is no threshold: bands need a thresholdsStyle, series a colour mode."""
    specs = [spec for spec in p.all_panels() if spec.thresholds is not None]
    assert len(specs) >= 8
    for spec in specs:
        defaults = _panel(spec.dashboard_uid, spec.title)["fieldConfig"]["defaults"]
        assert spec.thresholds is not None
        if spec.thresholds.style == p.BANDS:
            assert defaults["custom"]["thresholdsStyle"]["mode"] in {"area", "line+area", "dashed+area"}
        else:
            assert defaults["color"]["mode"] == "thresholds", spec.title


@pytest.mark.parametrize("uid", UIDS)
def test_each_dashboard_links_the_other_two_with_its_time_and_variables(uid: str) -> None:
    dashboard = committed(uid)
    assert dashboard["graphTooltip"] == 1  # a shared crosshair across the panels
    links = dashboard["links"]
    assert {link["url"] for link in links} == {f"/d/{other}" for other in UIDS if other != uid}
    for link in links:
        assert link["type"] == "link" and link["keepTime"] is True and link["includeVars"] is True, link
        other = link["url"].removeprefix("/d/")
        assert link["title"] == committed(other)["title"]


def test_no_operator_counter_is_drawn_raw() -> None:
    """A counter only climbs and restarts at zero with the operator: every panel reads the operator's
    counters through rate() or increase()."""
    counter = re.compile(r"(\w+)\((kvtune_operator_\w+_total)\{")
    for query in p.all_panel_queries():
        for name in re.findall(r"kvtune_operator_\w+_total", query.expr):
            wrapped = {function for function, inner in counter.findall(query.expr) if inner == name}
            assert wrapped and wrapped <= {"rate", "increase"}, f"{query.panel_title}: {query.expr}"


def test_rollbacks_are_a_rate_over_grafanas_interval() -> None:
    (query,) = [q for q in p.all_panel_queries() if "kvtune_operator_rollbacks_total" in q.expr]
    assert "increase(kvtune_operator_rollbacks_total{" in query.expr and "[$__rate_interval]" in query.expr
    assert all_variables(query.expr).endswith("[60s]))")  # Grafana's interval for a 15 s scrape
