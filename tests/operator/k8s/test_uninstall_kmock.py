"""`kvtune operator --delete-policies` (the chart's pre-delete hook, and what the README's uninstall order
does by hand) against kmock's Kubernetes API over real HTTP, with kopf's finalizers as the API server keeps
them. While the operator runs, it deletes every KVTuningPolicy of the namespaces named and returns once
kopf has released them; after the operator is gone a policy's finalizer holds it in Terminating, and the
command ends with an error naming it after its timeout, never a hang."""

from __future__ import annotations

import asyncio

import pytest

import kvtune.operator.k8s.handlers  # noqa: F401  (registers the handlers with kopf)
from kvtune.cli import main
from kvtune.errors import KvtuneError
from kvtune.operator.k8s import uninstall
from tests.operator.kmock_world import (
    POLICIES,
    OptimisticEmulator,
    kopf_running,
    policy_spec,
)

KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"


def add(kube: OptimisticEmulator, namespace: str, name: str, finalizers: tuple[str, ...] = ()) -> None:
    kube.objects[POLICIES, namespace, name] = {
        "apiVersion": "kvtune.dev/v1alpha1",
        "kind": "KVTuningPolicy",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1", "uid": f"uid-{name}",
                     "generation": 1, "finalizers": list(finalizers)},
        "spec": policy_spec("http://127.0.0.1:9", "Recommend"),  # nothing listens: evaluations find no data
    }  # fmt: skip


def left(kube: OptimisticEmulator) -> list[tuple[str, str]]:
    return sorted(
        (key[1], key[2]) for key in kube.objects if key[0] == POLICIES and not kube.objects[key].deleted
    )


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_every_policy_of_the_namespaces_named_is_deleted(
    kube: OptimisticEmulator, capsys: pytest.CaptureFixture[str]
) -> None:
    for namespace, name in (("team-a", "llama"), ("team-b", "mistral"), ("elsewhere", "kept")):
        add(kube, namespace, name)
    code = await asyncio.to_thread(
        main, ["operator", "--delete-policies", "--namespace", "team-a", "--namespace", "team-b"]
    )
    assert code == 0
    assert left(kube) == [("elsewhere", "kept")]  # a namespace not named is not touched
    out = capsys.readouterr().out
    assert "deleted 2 KVTuningPolicies: team-a/llama, team-b/mistral" in out
    assert "every KVTuningPolicy is gone" in out


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_while_the_operator_runs_its_finalizer_is_released_and_after_it_a_policy_hangs(
    kube: OptimisticEmulator,
) -> None:
    """The README's order, and why: kopf puts its finalizer on the policy; deleted while kopf runs, the
    policy goes; deleted once kopf has stopped, it stays in Terminating."""
    add(kube, "inference", "llama")
    add(kube, "team-b", "later")  # served by the operator too, then deleted after it stopped

    def finalized(namespace: str, name: str) -> bool:
        return KOPF_FINALIZER in kube.objects[POLICIES, namespace, name]["metadata"].get("finalizers", [])

    async with kopf_running(namespaces=("inference", "team-b")) as operator:
        await operator.until(lambda: finalized("inference", "llama") and finalized("team-b", "later"), 20,
                             "kopf put no finalizer on the policies")  # fmt: skip
        deleted = await asyncio.to_thread(
            uninstall.delete_policies, uninstall_store(["inference"]), 20.0, lambda line: None
        )
        assert deleted == ["inference/llama"] and left(kube) == [("team-b", "later")]
    with pytest.raises(KvtuneError, match=r"1 KVTuningPolicies still there after 2 s: team-b/later; is the "):
        await asyncio.to_thread(uninstall.run, ["team-b"], 2.0)
    assert left(kube) == [("team-b", "later")]
    assert kube.objects[POLICIES, "team-b", "later"]["metadata"].get("deletionTimestamp")  # Terminating


def uninstall_store(namespaces: list[str]) -> uninstall.PolicyStore:
    from kubernetes import client

    from kvtune.operator.k8s.kube_api import environment_configuration

    return uninstall.PolicyStore(
        client.CustomObjectsApi(client.ApiClient(environment_configuration())), namespaces
    )


def test_delete_policies_needs_the_namespaces(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator", "--delete-policies"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvtune: error: --delete-policies needs --namespace NS (repeatable) or --all-namespaces"
    )
