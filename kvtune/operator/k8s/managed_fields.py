"""Who set a container's args, from the workload's `metadata.managedFields` (server-side field ownership).
Pure. When a value the operator wrote is back to something else, this names the other writer (Argo CD,
Flux, a human's `kubectl apply`), so the operator can say who it is and stop fighting it.

A container's `args` is an atomic list: whoever last changed it (a merge patch, an update) or applied it
(server-side apply) owns all of it; managers that applied the same value share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldOwner:
    manager: str
    operation: str  # Apply (server-side apply) or Update (create, update, patch)
    time: str  # RFC 3339, as the API server wrote it ("" when absent)

    def describe(self) -> str:
        how = "server-side apply" if self.operation == "Apply" else self.operation.lower()
        return f"{self.manager} ({how}{f' at {self.time}' if self.time else ''})"


def container_key(name: str) -> str:
    """The key of one container in a fieldsV1 set: the list is a map keyed by name."""
    return "k:" + json.dumps({"name": name}, separators=(",", ":"))


def args_owners(workload: dict[str, Any], container: str) -> list[FieldOwner]:
    """The managers owning the container's args (its command too, where the flag lives there), the most
    recent first."""
    owners = []
    for entry in (workload.get("metadata") or {}).get("managedFields") or []:
        if not isinstance(entry, dict):
            continue
        fields = entry.get("fieldsV1") or {}
        for key in ("f:spec", "f:template", "f:spec", "f:containers", container_key(container)):
            fields = fields.get(key) if isinstance(fields, dict) else None
        if isinstance(fields, dict) and ("f:args" in fields or "f:command" in fields):
            owners.append(
                FieldOwner(str(entry.get("manager") or "unknown"), str(entry.get("operation") or ""),
                           str(entry.get("time") or ""))
            )  # fmt: skip
    return sorted(owners, key=lambda owner: owner.time, reverse=True)


def other_owner(workload: dict[str, Any], container: str, ours: str) -> FieldOwner | None:
    """The most recent manager other than `ours` that owns the container's args, or None."""
    return next((owner for owner in args_owners(workload, container) if owner.manager != ours), None)
