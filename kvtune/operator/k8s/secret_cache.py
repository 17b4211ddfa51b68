"""Secret keys the operator needs every tick (a kvtune engine's admin token), read whole only when the
Secret changed: each lookup asks the API server for the Secret's metadata alone and compares its
resourceVersion with the one last read, so the token neither travels nor is decoded on every tick, and a
rotated token is picked up on the next tick.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from kvtune.operator.k8s.kube_api import KubeApi, KubeError


@dataclass(frozen=True)
class _Read:
    resource_version: str | None
    data: dict[str, str]


@dataclass
class SecretCache:
    _reads: dict[tuple[str, str], _Read] = field(default_factory=dict)

    def value(self, api: KubeApi, namespace: str, name: str, key: str) -> str:
        """One key of a Secret, decoded; raises KubeError when the Secret or the key is missing."""
        version = api.read_secret_metadata(namespace, name).get("metadata", {}).get("resourceVersion")
        read = self._reads.get((namespace, name))
        if read is None or version is None or read.resource_version != version:
            secret = api.read_secret(namespace, name)
            read = _Read(secret.get("metadata", {}).get("resourceVersion"), dict(secret.get("data") or {}))
            self._reads[(namespace, name)] = read
        encoded = read.data.get(key)
        if encoded is None:
            raise KubeError(404, "KeyNotFound", f"secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(encoded).decode().strip()
