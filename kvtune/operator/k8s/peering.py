"""kopf peering for more than one operator replica (`kvtune operator --peering NAME`).

How kopf 1.45 picks the active peer (kopf/_core/engines/peering.py): every operator writes a keep-alive
`{identity: {priority, lifetime, lastseen}}` into the status of the peering object and watches it. An
operator that sees a live peer with a higher priority pauses (its watches and daemons stop); one that sees a
live peer with the *same* priority pauses too, and so does that peer: two equal priorities both freeze. The
replicas of one Deployment all get the same arguments, so a fixed `--priority` would freeze them all.
Therefore each process draws its own random priority (1 .. 2**31-1; a tie is a one-in-two-billion chance,
and it ends when either pod restarts): the replica with the highest priority acts, the others stand by and
take over once its keep-alive expires (`lifetime`, 60 s) or it leaves (it removes its own entry on exit).
There is no per-object lock: right after a replica starts it acts until it sees a higher peer (one keep-alive
round trip), so the active replica can change hands at a rollout.

Which peering objects must exist (kopf does not create them, and with a peering name given, kopf treats
peering as mandatory: an operator that cannot find its object stays paused and does nothing):
- namespaced (`--namespace A --namespace B`): a `KopfPeering` (kopf.dev/v1, namespaced) named NAME in *each*
  watched namespace (A and B); RBAC: list/watch/patch on kopfpeerings in those namespaces;
- cluster-wide (`--all-namespaces`): one `ClusterKopfPeering` (kopf.dev/v1, cluster-scoped) named NAME;
  RBAC: list/watch/patch on clusterkopfpeerings (kopf never reads a peering object by name).
Both CRDs (kopfpeerings.kopf.dev, clusterkopfpeerings.kopf.dev) must be installed with the objects; kopf
also discovers them through `GET /apis/kopf.dev/v1`. Without `--peering` the operator runs standalone
(one replica), reads no peering object and needs none.
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
