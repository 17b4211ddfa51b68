"""The chart under Argo CD, rendered as Argo CD renders it (`helm template`, with `--include-crds` or, for an
Application with `helm.skipCrds: true`, `--skip-crds`) and read with Argo CD's rules (tests/chart/argocd.py).
By default every CRD, kopf's shared peering CRDs included, carries Prune=false,Delete=false, so neither a
sync nor the Application's deletion takes them; `crds.argocdKeep: false` renders the same CRDs from the
templates without it. The uninstall hook is a PreDelete hook from Argo CD 3.3 on, and never runs before;
no sync ever runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.operator.k8s import crd_yaml
from tests.chart.argocd import (
    SYNC_OPTIONS,
    SYNC_PHASES,
    delete_policies,
    deleted_with_the_application,
    hook_phases,
    is_hook,
    pruned_by_a_sync,
    sync_options,
)
from tests.chart.helm import BASE_VALUES, CHART, NAMESPACE, RELEASE, by_kind, helm, merged

CRDS = {"kvtuningpolicies.kvtune.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
HOOK_KINDS = {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Job"}


def as_argocd_renders(
    values: dict[str, Any], tmp_path: Path, skip_crds: bool = False
) -> list[dict[str, Any]]:
    """`helm template` as Argo CD runs it for an Application with these values: CRDs included unless the
    Application sets `helm.skipCrds`."""
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(merged(BASE_VALUES, values)))
    crds = "--skip-crds" if skip_crds else "--include-crds"
    done = helm("template", RELEASE, CHART, "--namespace", NAMESPACE, "-f", values_file, crds)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def shipped_crds() -> dict[str, dict[str, Any]]:
    """The CRDs in the chart's crds/ folder, by name."""
    found = [
        doc
        for path in sorted((CHART / "crds").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
    ]
    return {doc["metadata"]["name"]: doc for doc in found if doc}


def test_by_default_no_sync_prunes_and_no_deletion_takes_a_crd(tmp_path: Path) -> None:
    crds = by_kind(as_argocd_renders({}, tmp_path), "CustomResourceDefinition")
    assert sorted(crd["metadata"]["name"] for crd in crds) == sorted(CRDS)  # each once: none from templates
    for crd in crds:
        assert sync_options(crd) == {"Prune": "false", "Delete": "false"}, crd["metadata"]
        assert not pruned_by_a_sync(crd) and not deleted_with_the_application(crd)


def test_the_generator_writes_the_annotation_on_kvtunes_crd() -> None:
    """The generated CRD carries it because crd_yaml.py writes it (the file is regenerated, never edited:
    tests/operator/k8s/test_crd.py fails on drift)."""
    assert crd_yaml.crd()["metadata"]["annotations"] == {SYNC_OPTIONS: "Prune=false,Delete=false"}
    assert shipped_crds()["kvtuningpolicies.kvtune.dev"]["metadata"]["annotations"] == {
        SYNC_OPTIONS: "Prune=false,Delete=false"
    }


def test_argocd_keep_false_renders_the_same_crds_without_the_annotation(tmp_path: Path) -> None:
    """For an Application with `helm.skipCrds: true`: the templates render each CRD of crds/, as it is there
    but for the sync options, so a sync may prune it."""
    rendered = as_argocd_renders({"crds": {"argocdKeep": False}}, tmp_path, skip_crds=True)
    crds = {crd["metadata"]["name"]: crd for crd in by_kind(rendered, "CustomResourceDefinition")}
    assert set(crds) == CRDS
    for name, shipped in shipped_crds().items():
        assert SYNC_OPTIONS not in (crds[name]["metadata"].get("annotations") or {})
        assert pruned_by_a_sync(crds[name])
        assert crds[name]["spec"] == shipped["spec"], name
    # and with the default, --skip-crds leaves no CRD at all: the templates render none
    assert by_kind(as_argocd_renders({}, tmp_path, skip_crds=True), "CustomResourceDefinition") == []


def uninstall_hook(
    values: dict[str, Any], tmp_path: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rendered hooks, and the rest (the Application's resources)."""
    objects = as_argocd_renders({"uninstall": {"deletePolicies": True}, **values}, tmp_path)
    return [o for o in objects if is_hook(o)], [o for o in objects if not is_hook(o)]


@pytest.mark.parametrize("values", [{}, {"clusterWide": True}], ids=["namespaced", "cluster-wide"])
def test_the_uninstall_hook_is_argocds_pre_delete_from_3_3_and_never_a_sync_hook(
    values: dict[str, Any], tmp_path: Path
) -> None:
    hooks, resources = uninstall_hook(values, tmp_path)
    assert {hook["kind"] for hook in hooks} == HOOK_KINDS - (
        {"Role", "RoleBinding"} if values else {"ClusterRole", "ClusterRoleBinding"}
    )
    for hook in hooks:
        name = f"{hook['kind']}/{hook['metadata']['name']}"
        assert hook_phases(hook, (3, 3)) == {"PreDelete"}, name  # deleting the Application runs it first
        assert hook_phases(hook, (3, 2)) == set(), name  # before 3.3: ignored, never run
        assert not hook_phases(hook, (3, 3)) & SYNC_PHASES, name  # no sync ever runs it
        assert delete_policies(hook) == {"BeforeHookCreation", "HookSucceeded"}, name
    (job,) = by_kind(hooks, "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["operator", "--delete-policies"]
    assert not [r for r in resources if r["metadata"]["name"].endswith("-delete-policies")]


def test_without_delete_policies_the_chart_has_no_hook_for_argocd(tmp_path: Path) -> None:
    assert [o["kind"] for o in as_argocd_renders({}, tmp_path) if is_hook(o)] == []
