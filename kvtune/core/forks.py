"""n > 1: the choices of one request share its prompt and split at the parent's first sample.

Choice 0 runs under the client's request id and is scheduled at once. Choices 1..n-1 ("<id>#<i>") wait
here until the parent's prompt is computed and it samples its first token; then they fork from the
parent's blocks (copy-on-write), so the prompt is computed once. A choice the allocator cannot fork is
queued as a request of its own.
"""

from __future__ import annotations

from kvtune.core import Request, Scheduler


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
        """Forget the choices still waiting on `parent_id` (it failed or was aborted) and return them."""
        return self._by_parent.pop(parent_id, [])

    def fork(self, scheduler: Scheduler, sampling: list[Request]) -> list[int]:
        """Start the waiting choices of every parent in `sampling`, which is about to sample.

        Forked choices are appended to `sampling`; the result gives, for each, its parent's position in
        `sampling`, whose logits it samples from in this same step.
        """
        parent_positions: list[int] = []
        for position, parent in enumerate(list(sampling)):
            for child in self._by_parent.pop(parent.request_id, []):
                if scheduler.fork_request(parent, child):
                    sampling.append(child)
                    parent_positions.append(position)
                else:
                    scheduler.add_request(child)
        return parent_positions

    def __len__(self) -> int:
        return sum(len(children) for children in self._by_parent.values())
