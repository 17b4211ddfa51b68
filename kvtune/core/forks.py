"""n > 1: the choices of one request share its prompt and split at the parent's first sample.

Choice 0 runs under the client's request id and is scheduled at once. Choices 1..n-1 ("<id>#<i>") wait
here, behind the scheduler, until the parent's prompt is computed and it samples its first token; then
`Scheduler.update_from_output` forks them from the parent's blocks (copy-on-write), so the prompt is
computed once, and they sample that step from the parent's logits. A choice the allocator cannot fork is
queued as a request of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtune.core.request import Request


def choice_id(client_id: str, index: int) -> str:
    """The engine-side id of choice `index` of client request `client_id`."""
    return client_id if index == 0 else f"{client_id}#{index}"


class PendingChoices:
    """Choices 1..n-1 of each n > 1 request whose parent has not sampled yet, by parent id."""

    def __init__(self) -> None:
        self._by_parent: dict[str, list[Request]] = {}

    def hold(self, parent_id: str, children: list[Request]) -> None:
        if children:
            self._by_parent[parent_id] = children

    def release(self, parent_id: str) -> list[Request]:
        """Forget the choices still waiting on `parent_id` (it sampled, failed or was aborted); return them."""
        return self._by_parent.pop(parent_id, [])

    def waiting_on(self, parents: Iterable[Request]) -> list[tuple[Request, Request]]:
        """(child, parent) for every choice waiting on one of `parents`, in their order: a query."""
        by_parent = self._by_parent
        return [(child, parent) for parent in parents for child in by_parent.get(parent.request_id, ())]

    def __bool__(self) -> bool:
        return bool(self._by_parent)

    def __len__(self) -> int:
        return sum(len(children) for children in self._by_parent.values())
