"""The chart as Argo CD sees it: Argo CD inflates a Helm chart with `helm template` (`--include-crds` unless
the Application sets `helm.skipCrds`) and then reads only annotations, so its view of each object is a pure
function of the rendered manifest. The rules, from Argo CD's source (argoproj/argo-cd):

- hooks (gitops-engine/pkg/sync/hook/hook.go, .../hook/helm/type.go, controller/hook.go): an
  `argocd.argoproj.io/hook` annotation wins over Helm's; else `helm.sh/hook` maps pre-install and
  pre-upgrade to PreSync, post-install and post-upgrade to PostSync, post-delete to PostDelete (v2.10 on)
  and pre-delete to PreDelete (v3.3.0 on, commit 3bf3d8a, "PreDelete hooks support"); any other Helm hook
  is ignored, and the object is still a hook, so no sync ever applies it;
- hook delete policies (.../hook/helm/delete_policy.go): `helm.sh/hook-delete-policy` before-hook-creation,
  hook-succeeded and hook-failed become BeforeHookCreation, HookSucceeded and HookFailed;
- sync options (`argocd.argoproj.io/sync-options`): Prune=false keeps an object a sync would prune
  (gitops-engine/pkg/sync/sync_context.go, isPruningDisabled), Delete=false one the Application's deletion
  would delete; `helm.sh/resource-policy: keep` counts as Delete=false, and a CRD is never deleted with its
  Application (controller/appcontroller.go, shouldBeDeleted).
"""

from __future__ import annotations

from typing import Any

ARGOCD_HOOK = "argocd.argoproj.io/hook"
ARGOCD_HOOK_DELETE_POLICY = "argocd.argoproj.io/hook-delete-policy"
SYNC_OPTIONS = "argocd.argoproj.io/sync-options"
HELM_HOOK = "helm.sh/hook"
HELM_HOOK_DELETE_POLICY = "helm.sh/hook-delete-policy"
# Helm's hook -> Argo CD's phase, and the first Argo CD release that maps it
HELM_HOOK_PHASES = {
    "pre-install": ("PreSync", (1, 0)),
    "pre-upgrade": ("PreSync", (1, 0)),
    "post-install": ("PostSync", (1, 0)),
    "post-upgrade": ("PostSync", (1, 0)),
    "post-delete": ("PostDelete", (2, 10)),
    "pre-delete": ("PreDelete", (3, 3)),
}
HELM_DELETE_POLICIES = {
    "before-hook-creation": "BeforeHookCreation",
    "hook-succeeded": "HookSucceeded",
    "hook-failed": "HookFailed",
}
SYNC_PHASES = {"PreSync", "Sync", "PostSync", "SyncFail"}


def annotations(obj: dict[str, Any]) -> dict[str, str]:
    found: dict[str, str] = obj.get("metadata", {}).get("annotations") or {}
    return found


def csv(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


def is_hook(obj: dict[str, Any]) -> bool:
    """A hook is never applied as one of the Application's resources (only in its phase, if it has one)."""
    found = annotations(obj)
    return ARGOCD_HOOK in found or found.get(HELM_HOOK, "crd-install") != "crd-install"


def hook_phases(obj: dict[str, Any], version: tuple[int, int]) -> set[str]:
    """The phases Argo CD `version` runs `obj` in (empty: never run)."""
    found = annotations(obj)
    if ARGOCD_HOOK in found:
        return set(csv(found[ARGOCD_HOOK]))
    return {
        phase
        for hook in csv(found.get(HELM_HOOK))
        if hook in HELM_HOOK_PHASES
        for phase, since in [HELM_HOOK_PHASES[hook]]
        if version >= since
    }


def delete_policies(obj: dict[str, Any]) -> set[str]:
    found = annotations(obj)
    if ARGOCD_HOOK_DELETE_POLICY in found:
        return set(csv(found[ARGOCD_HOOK_DELETE_POLICY]))
    return {
        HELM_DELETE_POLICIES[p] for p in csv(found.get(HELM_HOOK_DELETE_POLICY)) if p in HELM_DELETE_POLICIES
    }


def sync_options(obj: dict[str, Any]) -> dict[str, str]:
    """`Prune=false,Delete=false` -> {"Prune": "false", "Delete": "false"}."""
    return dict(item.split("=", 1) for item in csv(annotations(obj).get(SYNC_OPTIONS)) if "=" in item)


def pruned_by_a_sync(obj: dict[str, Any]) -> bool:
    """Whether a sync that prunes deletes `obj` once it leaves the rendered manifest."""
    return sync_options(obj).get("Prune") != "false"


def deleted_with_the_application(obj: dict[str, Any]) -> bool:
    """Whether a cascading deletion of the Application deletes `obj`."""
    keep = "keep" in csv(annotations(obj).get("helm.sh/resource-policy"))
    return (
        obj["kind"] != "CustomResourceDefinition" and sync_options(obj).get("Delete") != "false" and not keep
    )
