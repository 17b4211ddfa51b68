"""kopf peering for more than one operator replica (`kvtune operator --peering NAME`): each process draws
its own random priority, since equal priorities freeze every replica of a Deployment. How kopf picks the
active peer, and which peering objects and RBAC must exist: ARCHITECTURE.md, "Operator replicas".
"""

from __future__ import annotations

import secrets
from typing import Any

PRIORITY_CEILING = 2**31 - 1  # priorities travel as JSON integers in the peering object's status


def random_priority() -> int:
    """This process's peering priority: distinct from every other replica's with near certainty."""
    return 1 + secrets.randbelow(PRIORITY_CEILING)


def kopf_peering_arguments(name: str | None) -> dict[str, Any]:
    """`kopf.run` / `kopf.operator` keyword arguments: standalone without a name; else mandatory peering
    through the object `name` at a random priority of this process."""
    if name is None:
        return {"standalone": True}
    return {"standalone": False, "peering_name": name, "priority": random_priority()}
