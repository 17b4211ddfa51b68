"""docs/running-apply-safely.md is the page a platform team signs off on before Apply (issue 37): every
policy field, condition and Event reason it names must exist. The page follows these conventions, and
this test reads them:

- a backticked `spec.a.b` or `status.a.b` is a path in the CRD's schema (generated from crd.py);
- any other backticked camelCase name (a lower-case start and a capital, dots allowed) is a field of the
  CRD's schema, else a key path of the chart's values.yaml, else another API's name listed in OTHER_APIS;
- a YAML block with a top-level `spec:` holds only key paths of the spec's schema;
- "condition `X`" and "`X` condition" name a condition type; "Event `X`" and "`X` Event(s)" name an Event
  reason the operator's code posts;
- any backticked PascalCase name is a condition type, an Event reason, a name the operator's code spells
  as a string (a condition's reason, a mode), a value the CRD enumerates, or an alert;
- a backticked `kvtune_operator_*` series is one the operator exports.

The same checker runs on a page with one wrong name of each kind, and must name every one."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml

from kvtune.operator.decide.policy import default_timing
from kvtune.operator.decide.status import ConditionType
from kvtune.operator.k8s import crd_yaml
from tests.observability.event_reasons import event_reasons_in_code

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "running-apply-safely.md"
OPERATOR = ROOT / "kvtune" / "operator"
VALUES = ROOT / "charts" / "kvtune" / "values.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks"

# names of other projects' APIs the page uses, each with where it comes from
OTHER_APIS = {
    "managedFields": "Kubernetes: an object's metadata.managedFields",
    "progressDeadlineSeconds": "Kubernetes: a Deployment's spec",
    "maxSurge": "Kubernetes: a Deployment's rolling-update strategy",
    "maxUnavailable": "Kubernetes: a Deployment's rolling-update strategy",
    "ignoreDifferences": "Argo CD: an Application's spec",
}

BACKTICKED = re.compile(r"`([^`\n]+)`")
FIELD = re.compile(r"^[a-z][a-zA-Z0-9]*(\.[a-z][a-zA-Z0-9]*)*$")
PASCAL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
METRIC = re.compile(r"^kvtune_operator_\w+$")
CONDITION_MENTION = re.compile(r"\bcondition\s+`(\w+)`|`(\w+)`\s+condition\b")
EVENT_MENTION = re.compile(r"\bEvents?\s+`(\w+)`|`(\w+)`\s+Events?\b")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
Schema = dict[str, Any]


def walk(node: Schema) -> Iterator[Schema]:
    yield node
    for child in node.get("properties", {}).values():
        yield from walk(child)
    if "items" in node:
        yield from walk(node["items"])


def has_path(node: Schema, parts: list[str]) -> bool:
    for part in parts:
        while "items" in node:
            node = node["items"]
        properties = node.get("properties", {})
        if part not in properties:
            return False
        node = properties[part]
    return True


def key_paths(value: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path of a YAML document (list items are walked as their schema's `items`)."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield (*prefix, str(key))
            yield from key_paths(child, (*prefix, str(key)))
    elif isinstance(value, list):
        for item in value:
            yield from key_paths(item, prefix)


@dataclass(frozen=True)
class Known:
    """Everything the page may name, from the CRD, the code, the chart and the alerts."""

    schema: Schema  # the CRD's openAPIV3Schema
    condition_types: frozenset[str]
    event_reasons: frozenset[str]
    spelled: frozenset[str]  # PascalCase strings in the operator's code
    enums: frozenset[str]  # values the CRD enumerates
    alerts: frozenset[str]
    values: frozenset[str]  # the chart's values, as dotted key paths
    code: str  # the operator's code, to find the series it exports


def known() -> Known:
    schema = crd_yaml.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    code = "\n".join(path.read_text() for path in sorted(OPERATOR.rglob("*.py")))
    values = {".".join(path) for path in key_paths(yaml.safe_load(VALUES.read_text()))}
    return Known(
        schema=schema,
        condition_types=frozenset(get_args(ConditionType)),
        event_reasons=frozenset(reason for reason, _ in event_reasons_in_code()),
        spelled=frozenset(re.findall(r'"([A-Z][A-Za-z0-9]+)"', code)),
        enums=frozenset(str(v) for node in walk(schema) for v in node.get("enum", [])),
        alerts=frozenset(path.stem for path in RUNBOOKS.glob("*.md")) - {"README"},
        values=frozenset(values),
        code=code,
    )


def field_problem(name: str, k: Known) -> str | None:
    parts = name.split(".")
    if parts[0] in ("spec", "status") and len(parts) > 1:
        return None if has_path(k.schema, parts) else f"`{name}`: no such field in the CRD"
    if any(c.isupper() for c in name):
        in_crd = any(has_path(node, parts) for node in walk(k.schema))
        if not (in_crd or name in k.values or name in OTHER_APIS):
            return f"`{name}`: not a CRD field, a chart value nor in OTHER_APIS"
    return None


def name_problem(name: str, k: Known) -> str | None:
    if FIELD.match(name):
        return field_problem(name, k)
    if METRIC.match(name):
        series = name.removesuffix("_total")
        return None if f'"{series}"' in k.code else f"`{name}`: the operator exports no such series"
    if PASCAL.match(name):
        names = k.condition_types | k.event_reasons | k.spelled | k.enums | k.alerts
        return None if name in names else f"`{name}`: no condition, Event reason, value or alert of that name"
    return None


def yaml_problems(body: str, k: Known) -> list[str]:
    document = yaml.safe_load(body)
    if not isinstance(document, dict) or "spec" not in document:
        return []
    spec = k.schema["properties"]["spec"]
    return [
        f"YAML `spec.{'.'.join(path)}`: no such field in the CRD"
        for path in key_paths(document["spec"])
        if not has_path(spec, list(path))
    ]


def problems(text: str, k: Known) -> list[str]:
    """Every name of the page that does not exist, one line each."""
    found: list[str] = []
    for language, body in FENCE.findall(text):
        if language == "yaml":
            found += yaml_problems(body, k)
    prose = FENCE.sub("", text)
    for name in BACKTICKED.findall(prose):
        problem = name_problem(name.strip(), k)
        if problem is not None and problem not in found:
            found.append(problem)
    for groups in CONDITION_MENTION.findall(prose):
        name = next(g for g in groups if g)
        if name not in k.condition_types:
            found.append(f"condition `{name}`: the CRD has no such condition type")
    for groups in EVENT_MENTION.findall(prose):
        name = next(g for g in groups if g)
        if name not in k.event_reasons:
            found.append(f"Event `{name}`: the operator posts no Event with that reason")
    return found


def test_every_field_condition_and_event_reason_the_page_names_exists() -> None:
    assert problems(PAGE.read_text(), known()) == []


def test_the_checker_names_every_wrong_name_of_each_kind() -> None:
    wrong = """
The `spec.evaluationWindowSecs` field, `status.timing.source`, and `restartBudget.maxChanges`.
The condition `Readyy` and the `TuningApplyed` Event; the reason `BudgetGone`; `kvtune_operator_restarts_total`.

```yaml
spec:
  restartBudget: {maxRestarts: 2, window: {start: "02:00"}}
```
"""
    found = problems(wrong, known())
    for name in (
        "`spec.evaluationWindowSecs`",
        "`status.timing.source`",
        "`restartBudget.maxChanges`",
        "condition `Readyy`",
        "Event `TuningApplyed`",
        "`BudgetGone`",
        "`kvtune_operator_restarts_total`",
        "`spec.restartBudget.window`",
        "`spec.restartBudget.window.start`",
    ):
        assert any(name in line for line in found), (name, found)
    right = """
`spec.restartBudget.maintenanceWindow.start`, `status.tunerState.restarts`, `maxMode`, `cooldownSeconds`;
the condition `Ready` with reason `RestartBudgetSpent`, a `ChangeHeld` Event, `kvtune_operator_actions_total`.
"""
    assert problems(right, known()) == []


def test_the_page_states_the_engine_defaults_the_operator_uses() -> None:
    text = PAGE.read_text()
    gpu, live = default_timing("vllm"), default_timing("kvtune")
    assert default_timing("sglang") == gpu
    assert f"| `vllm`, `sglang` | {gpu.evaluation_window_s:.0f} s | {gpu.cooldown_s:.0f} s |" in text
    assert f"| `kvtune` | {live.evaluation_window_s:.0f} s | {live.cooldown_s:.0f} s |" in text
