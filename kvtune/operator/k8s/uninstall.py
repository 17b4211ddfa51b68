"""`kvtune operator --delete-policies`: delete every KVTuningPolicy in the watched namespaces and wait until
they are gone, while the operator still runs. kopf keeps a finalizer on each policy it serves and only a
running operator takes it off; a policy deleted after `helm uninstall` removed the operator hangs in
Terminating. The chart's optional pre-delete hook runs this, in the operator's image, before Helm deletes
anything else (`uninstall.deletePolicies`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvtune.errors import KvtuneError
from kvtune.operator.k8s.crd import GROUP, PLURAL, VERSION
from kvtune.operator.k8s.kube_api import KubeError, environment_configuration

POLL_S = 1.0


def _names(items: list[dict[str, Any]]) -> list[str]:
    return sorted(f"{item['metadata'].get('namespace')}/{item['metadata']['name']}" for item in items)


def _failure(what: str, err: ApiException) -> KvtuneError:
    return KvtuneError(f"{what}: HTTP {err.status} {err.reason}")


class PolicyStore:
    """The KVTuningPolicies of some namespaces (or of every one), through the official client."""

    def __init__(self, api: client.CustomObjectsApi, namespaces: Sequence[str]) -> None:
        self.api = api
        self.namespaces = list(namespaces)

    def list(self) -> list[dict[str, Any]]:
        try:
            if not self.namespaces:
                listed: Any = self.api.list_cluster_custom_object(GROUP, VERSION, PLURAL)
                return list(listed["items"])
            found: list[dict[str, Any]] = []
            for namespace in self.namespaces:
                listed = self.api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
                found += listed["items"]
            return found
        except ApiException as err:
            raise _failure("listing the KVTuningPolicies", err) from None

    def delete(self, namespace: str, name: str) -> None:
        try:
            self.api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as err:
            if err.status != 404:  # already gone
                raise _failure(f"deleting KVTuningPolicy {namespace}/{name}", err) from None


def delete_policies(
    store: PolicyStore,
    timeout_s: float,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Delete every policy the store lists, then wait until none is left; returns the names deleted. A
    policy still there after `timeout_s` (no operator to release it) is an error naming it."""
    policies = store.list()
    deleted = _names(policies)
    for item in policies:
        store.delete(item["metadata"]["namespace"], item["metadata"]["name"])
    say(f"deleted {len(deleted)} KVTuningPolicies: {', '.join(deleted) or 'none'}")
    deadline = clock() + timeout_s
    while left := _names(store.list()):
        if clock() > deadline:
            raise KvtuneError(
                f"{len(left)} KVTuningPolicies still there after {timeout_s:.0f} s: {', '.join(left)}; is the "
                "operator running? Only it takes off the kopf finalizer (see README, Uninstall)"
            )
        time.sleep(POLL_S)
    say("every KVTuningPolicy is gone")
    return deleted


def run(namespaces: Sequence[str], timeout_s: float) -> int:
    """The CLI's entry: the pod's service account (else the kubeconfig), the namespaces named (none: all)."""
    if timeout_s <= 0:
        raise KvtuneError(f"--timeout must be positive, got {timeout_s:g}")
    try:
        api_client = client.ApiClient(environment_configuration())
    except KubeError as err:
        raise KvtuneError(str(err)) from None
    try:
        delete_policies(PolicyStore(client.CustomObjectsApi(api_client), namespaces), timeout_s)
    finally:
        api_client.close()  # type: ignore[no-untyped-call]
    return 0
