"""Chat bodies that share one long system prompt, with the part that varies at the head (a prefix-cache
defeat: every prompt unique from its first block) or after it (clean shared-prefix traffic)."""

from __future__ import annotations

SHARED_SYSTEM_PROMPT = "".join(
    f"Rule {n}: {rule}. "
    for n, rule in enumerate(
        (
            "You are the support assistant of a hardware store",
            "answer in two sentences at most",
            "name the aisle where each product is",
            "never guess a price, look it up",
            "ask for the order number before discussing a return",
            "garden tools are seasonal, say so between October and March",
            "paint is mixed at the counter near the entrance",
            "keys are cut while the customer waits, about five minutes",
            "the store opens at eight and closes at seven on weekdays",
            "refer electrical questions to a licensed electrician",
            "offer the loyalty card once per conversation",
        )
    )
)


def stamped_chat(i: int) -> dict:
    """A system prompt with a timestamp and a request id at its head: every prompt unique from token ~0."""
    head = f"[2026-12-01T14:{i:02d}:{(7 * i) % 60:02d}.{(131 * i) % 1000:03d}Z req-{i * 7919:08x}] "
    return chat(head + SHARED_SYSTEM_PROMPT, f"Where are the hammers? ({i})")


def clean_chat(i: int) -> dict:
    """The same, with the varying part moved after the shared prompt."""
    return chat(SHARED_SYSTEM_PROMPT + f"[2026-12-01T14:{i:02d}:00Z req-{i * 7919:08x}]", f"Hammers? ({i})")


def chat(system: str, user: str) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "tiny", "messages": messages, "max_tokens": 1}
