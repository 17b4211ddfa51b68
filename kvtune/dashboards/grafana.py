"""The three Grafana dashboards, built from `panels.py` with grafana-foundation-sdk's typed builders.

The SDK is pinned to its Grafana 11.6 build (schemaVersion 41, which newer Grafanas migrate on load); an
unpinned install picks the 10.1 build. The datasource is the `datasource` variable, never a fixed uid, so
the same JSON loads into any Grafana. Each dashboard links to the other two (keeping the time range and the
variables) and shares its crosshair across its panels, so one moment can be followed from panel to panel.
"""

from __future__ import annotations

import json
import re
from typing import Any

from grafana_foundation_sdk.builders.common import GraphThresholdsStyleConfig, VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    FieldColor,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    GraphGradientMode,
    GraphThresholdsStyleMode,
    LegendDisplayMode,
    LegendPlacement,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DynamicConfigValue,
    FieldColorModeId,
    GridPos,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from kvtune.dashboards import panels as p

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
TITLES = {
    p.KV_CACHE_UID: "kvtune / KV cache",
    p.OPERATOR_UID: "kvtune / operator",
    p.LATENCY_UID: "kvtune / latency",
}
DESCRIPTIONS = {
    p.KV_CACHE_UID: "KV-cache pressure per pod and summed, on vLLM, SGLang and kvtune (kvtune_engine: rules).",
    p.OPERATOR_UID: "What the kvtune operator saw and did: actions, knobs, the remedy ladder, its health.",
    p.LATENCY_UID: "TTFT, inter-token, end-to-end and queue latency percentiles, preemptions overlaid.",
}
PANEL_WIDTH, PANEL_HEIGHT = 12, 8
ALL = VariableOption(selected=True, text="All", value="$__all")

# Each variable's values come from a series every engine (or the operator) exports, narrowed by the ones
# chosen before it.
ENGINE_VARIABLES = (
    ("namespace", "Namespace", "label_values(kvtune_engine:up, namespace)"),
    ("model", "Model", 'label_values(kvtune_engine:up{namespace=~"$namespace"}, model_name)'),
    ("pod", "Pod", 'label_values(kvtune_engine:up{namespace=~"$namespace", model_name=~"$model"}, pod)'),
)
POLICY_VARIABLE = (
    "policy",
    "Policy",
    'label_values(kvtune_operator_last_evaluation_timestamp_seconds{namespace=~"$namespace"}, policy)',
)
# The operator dashboard's namespaces are the policies' own (its series carry them, kept by the chart's
# ServiceMonitor with honorLabels), so it fills without the engines scraped.
OPERATOR_NAMESPACE_VARIABLE = (
    "namespace",
    "Namespace",
    "label_values(kvtune_operator_last_evaluation_timestamp_seconds, namespace)",
)


def _variable(name: str, label: str, query: str) -> QueryVariable:
    """A multi-value query variable whose "All" is `.*`, so a missing label (a local scrape without a pod
    label) still matches."""
    return (
        QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL)
    )


def _annotation(name: str, expr: str, color: str) -> AnnotationQuery:
    return AnnotationQuery().name(name).datasource(DATASOURCE).expr(expr).enable(True).icon_color(color)


def _link(uid: str) -> DashboardLink:
    """A link to another kvtune dashboard by its uid (Grafana prefixes its sub-path to a URL that starts with
    `/`), carrying the time range and every variable, so the view moves with the reader."""
    return (
        DashboardLink(TITLES[uid])
        .type(DashboardLinkType.LINK)
        .url(f"/d/{uid}")
        .tooltip(DESCRIPTIONS[uid])
        .icon("dashboard")
        .keep_time(True)
        .include_vars(True)
        .target_blank(False)
    )


def _with_thresholds(panel: Timeseries, thresholds: p.Thresholds) -> Timeseries:
    """The steps over a healthy base: transparent under bands (nothing drawn where all is well), green under
    coloured series (a line at zero is healthy, and shows it)."""
    base = "transparent" if thresholds.style == p.BANDS else "green"
    steps = [Threshold(value=None, color=base), *(Threshold(value=v, color=c) for v, c in thresholds.steps)]
    panel = panel.thresholds(ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps))
    if thresholds.style == p.BANDS:
        return panel.thresholds_style(
            GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.DASHED_AND_AREA)
        )
    return (
        panel.color_scheme(FieldColor().mode(FieldColorModeId.THRESHOLDS))
        .gradient_mode(GraphGradientMode.SCHEME)
        .thresholds_style(GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.OFF))
    )


def _panel(spec: p.PanelSpec, panel_id: int, x: int, y: int) -> Timeseries:
    panel = (
        Timeseries()
        .id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .min(0)
        .grid_pos(GridPos(h=PANEL_HEIGHT, w=PANEL_WIDTH, x=x, y=y))
        .legend(
            VizLegendOptions()
            .show_legend(True)
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
        )
    )
    if spec.unit == p.RATIO:
        panel = panel.max(1)  # the pool: a ratio's axis always shows where full is
    if spec.thresholds is not None:
        panel = _with_thresholds(panel, spec.thresholds)
    for index, target in enumerate(spec.targets):
        ref_id = chr(ord("A") + index)
        panel = panel.with_target(
            Dataquery().expr(target.expr).legend_format(target.legend).ref_id(ref_id).datasource(DATASOURCE)
        )
        if target.unit != spec.unit:  # a second quantity: its own unit, on the right axis
            panel = panel.override_by_query(
                ref_id,
                [
                    DynamicConfigValue(id_val="unit", value=target.unit),
                    DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                ],
            )
    return panel


def build_dashboard(uid: str) -> Dashboard:
    """One dashboard: its variables, then its panels in rows, two panels across, ids unique."""
    specs = [spec for spec in p.all_panels() if spec.dashboard_uid == uid]
    dashboard = (
        Dashboard(TITLES[uid])
        .uid(uid)
        .description(DESCRIPTIONS[uid])
        .tags(["kvtune", "generated"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .links([_link(other) for other in dashboard_uids() if other != uid])
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    used = {name for spec in specs for target in spec.targets for name in _variables_in(target.expr)}
    variables = ENGINE_VARIABLES
    if uid == p.OPERATOR_UID:
        variables = (OPERATOR_NAMESPACE_VARIABLE, *ENGINE_VARIABLES[1:])
    for name, label, query in variables:
        dashboard = dashboard.with_variable(_variable(name, label, query))
    if "policy" in used:
        dashboard = dashboard.with_variable(_variable(*POLICY_VARIABLE))
    dashboard = dashboard.annotation(_annotation("Preemptions", p.PREEMPTION_ANNOTATION, "red"))
    if uid == p.OPERATOR_UID:
        dashboard = dashboard.annotation(_annotation("Operator actions", p.ACTION_ANNOTATION, "orange"))
    next_id, y, row_title, column = 1, 0, None, 0
    for spec in specs:
        if spec.row != row_title:
            y += 0 if column == 0 else PANEL_HEIGHT
            dashboard = dashboard.with_row(
                Row(spec.row).id(next_id).grid_pos(GridPos(h=1, w=24, x=0, y=y)).collapsed(False)
            )
            next_id, y, row_title, column = next_id + 1, y + 1, spec.row, 0
        dashboard = dashboard.with_panel(_panel(spec, next_id, column * PANEL_WIDTH, y))
        next_id += 1
        column = (column + 1) % 2
        if column == 0:
            y += PANEL_HEIGHT
    return dashboard


def _variables_in(expr: str) -> list[str]:
    """The dashboard variables a query uses; Grafana's own (`$__rate_interval`) are not the dashboard's."""
    return [name for name in re.findall(r"\$([a-z_]+)", expr) if not name.startswith("__")]


def dashboard_uids() -> list[str]:
    return list(TITLES)


def dashboard_json(uid: str) -> str:
    """The dashboard as the bytes committed in dashboards/: sorted keys, so a rebuild is byte-identical."""
    return JSONEncoder(sort_keys=True, indent=2).encode(build_dashboard(uid).build()) + "\n"


def dashboard_model(uid: str) -> dict[str, Any]:
    """The dashboard as a JSON object (what `push` uploads)."""
    model: dict[str, Any] = json.loads(dashboard_json(uid))
    return model
