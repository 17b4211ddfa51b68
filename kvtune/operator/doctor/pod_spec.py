"""`kvtune doctor --pod NAMESPACE/NAME`: read one pod's spec (the kubeconfig's credentials, or the
in-cluster ServiceAccount's) so the doctor learns vLLM's flags from the container that runs it. One `get`
on one pod is all it needs; every failure is one KvtuneError line."""

from __future__ import annotations

import os
from typing import Any

from kvtune.errors import KvtuneError

READ_TIMEOUT_S = 10.0


def split_pod_ref(ref: str) -> tuple[str | None, str]:
    """`NAMESPACE/NAME` -> (namespace, name); `NAME` -> (None, name): the kubeconfig context's namespace."""
    namespace, slash, name = ref.partition("/")
    if not slash:
        namespace, name = "", ref
    if not name or "/" in name or (slash and not namespace):
        raise KvtuneError(f"--pod {ref!r}: expected NAMESPACE/NAME or NAME")
    return namespace or None, name


def read_pod(ref: str) -> dict[str, Any]:
    """The pod as the API server returns it (a plain dict)."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException

    namespace, name = split_pod_ref(ref)
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        namespace = namespace or _incluster_namespace()
    except ConfigException:
        try:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # type: ignore[no-untyped-call]
        except (ConfigException, OSError) as err:
            raise KvtuneError(f"--pod {ref}: no cluster credentials: {err}") from None
        if namespace is None:
            _, context = config.list_kube_config_contexts(os.environ.get("KUBECONFIG"))  # type: ignore[no-untyped-call]
            namespace = (context or {}).get("context", {}).get("namespace") or "default"
    api = client.ApiClient()
    try:
        pod = client.CoreV1Api(api).read_namespaced_pod(name, namespace, _request_timeout=READ_TIMEOUT_S)
        return dict(api.sanitize_for_serialization(pod))  # type: ignore[no-untyped-call]
    except ApiException as err:
        raise KvtuneError(f"--pod {namespace}/{name}: HTTP {err.status} {err.reason}") from None
    except Exception as err:  # urllib3's connection errors, a name that does not resolve, a timeout
        raise KvtuneError(f"--pod {namespace}/{name}: {type(err).__name__}: {err}") from None
    finally:
        api.close()  # type: ignore[no-untyped-call]


def _incluster_namespace() -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace", encoding="utf-8") as file:
            return file.read().strip() or "default"
    except OSError:
        return "default"
