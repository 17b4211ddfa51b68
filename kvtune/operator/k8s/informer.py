"""What the operator's watches have seen of the workloads it tunes: their Deployments and StatefulSets and
their Services' EndpointSlices, kept from kopf's watch events (handlers.py) so an evaluation reads them from
memory instead of a GET and a LIST each tick, as controller-runtime's cached client does. A patch still
reads the workload fresh (its resourceVersion guards the write).

An entry is trusted for `max_age` seconds after the event that brought it: a watch re-listed after it
expired (410 Gone) never says which objects went while it was down, and an object no event touches for
that long is read from the API server again (and kept) at its next use."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Json = dict[str, Any]
SERVICE_LABEL = "kubernetes.io/service-name"
MAX_AGE_S = 600.0


def _revision(obj: Json) -> int | None:
    """The object's resourceVersion as a number (etcd's revision), None when it is not one."""
    version = (obj.get("metadata") or {}).get("resourceVersion")
    try:
        return int(version) if version is not None else None
    except (TypeError, ValueError):
        return None


class ObjectCache:
    """Thread-safe; fed from the event loop, read from the evaluation threads."""

    def __init__(self, max_age: float = MAX_AGE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age = max_age
        self.clock = clock
        self._lock = threading.Lock()
        self._workloads: dict[tuple[str, str, str], tuple[Json, float]] = {}
        self._slices: dict[tuple[str, str], dict[str, tuple[Json, float]]] = {}

    def saw(self, kind: str, event_type: str | None, obj: Json) -> None:
        """One watch event: ADDED / MODIFIED / None (kopf's listing) keep the object, DELETED drops it."""
        metadata = obj.get("metadata") or {}
        namespace, name = metadata.get("namespace"), metadata.get("name")
        if not namespace or not name:
            return
        now = self.clock()
        with self._lock:
            if kind == "EndpointSlice":
                service = (metadata.get("labels") or {}).get(SERVICE_LABEL)
                if not service:
                    return
                slices = self._slices.setdefault((namespace, service), {})
                if event_type == "DELETED":
                    slices.pop(name, None)
                else:
                    slices[name] = (obj, now)
            elif event_type == "DELETED":
                self._workloads.pop((kind, namespace, name), None)
            else:
                self._workloads[(kind, namespace, name)] = (obj, now)

    def read_through(self, kind: str, obj: Json) -> None:
        """Keep an object the API server answered, unless a watch has already brought a newer one."""
        metadata = obj.get("metadata") or {}
        namespace, name = metadata.get("namespace"), metadata.get("name")
        if not namespace or not name:
            return
        key = (kind, str(namespace), str(name))
        with self._lock:
            kept = self._workloads.get(key)
            newer = kept is not None and (_revision(kept[0]) or 0) > (_revision(obj) or 0)
            if not newer:
                self._workloads[key] = (obj, self.clock())

    def workload(self, kind: str, namespace: str, name: str) -> Json | None:
        """The Deployment or StatefulSet as the watch last saw it, or None (not seen, or seen too long ago)."""
        with self._lock:
            kept = self._workloads.get((kind, namespace, name))
            fresh = kept is not None and self.clock() - kept[1] < self.max_age
            return kept[0] if fresh and kept is not None else None

    def endpoint_slices(self, namespace: str, service: str) -> list[Json] | None:
        """The Service's EndpointSlices as the watch last saw them, or None when it has seen none (or when
        one of them is older than max_age: then all are read again)."""
        with self._lock:
            kept = self._slices.get((namespace, service)) or {}
            now = self.clock()
            fresh = bool(kept) and all(now - at < self.max_age for _, at in kept.values())
            return [obj for obj, _ in kept.values()] if fresh else None

    def read_through_slices(self, namespace: str, service: str, slices: list[Json]) -> None:
        """Keep a LIST's answer for the Service (the watch replaces each slice as it changes)."""
        now = self.clock()
        with self._lock:
            self._slices[(namespace, service)] = {
                str((s.get("metadata") or {}).get("name")): (s, now) for s in slices
            }
