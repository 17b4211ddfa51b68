"""What an operator replica's own log says of its place in kopf's peering: shared by the peering and
takeover tests (test_peering.py, test_faults_takeover.py)."""

from __future__ import annotations

from tests.e2e.cluster import Operator


def resumed(replica: Operator) -> bool:
    """Whether kopf's peering last resumed this replica (its log: kopf says so only on a change)."""
    log = replica.output()
    return log.rfind("Resuming operations after the pause") > log.rfind("Pausing operations in favour of")
