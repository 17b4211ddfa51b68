"""Prefix hashes: a full block's identity chains its parent's hash with its own token ids.

Chaining makes a block's hash depend on everything before it, so two requests share block n only when
they agree on every token up to the end of block n. That is why a timestamp at the front of a prompt
defeats the cache, and why a shared prefix shorter than one block shares nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

# The hash of the (absent) parent of block 0. Any fixed value works; it only has to be the same everywhere.
ROOT_HASH = 0x6B767475


def salted_root(salt: str | None) -> int:
    """The root a prompt's chain starts from: ROOT_HASH, or one derived from a request's `cache_salt`.

    Every block hash chains from the root, so prompts under different salts share no block even when their
    tokens agree (vLLM's `cache_salt`: tenants that must not learn from each other's cache hits). The salt's
    UTF-8 bytes are hashed as a block of ints, so the root is the same in every process (no str hash).
    """
    if salt is None:
        return ROOT_HASH
    return hash_block_tokens(ROOT_HASH, tuple(salt.encode("utf-8", "surrogatepass")))


def hash_block_tokens(parent_hash: int, tokens: Sequence[int]) -> int:
    """Hash one full block. Python's tuple-of-int hash is deterministic across processes (no salt)."""
    return hash((parent_hash, tuple(tokens)))


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    start: int = 0,
    parent: int = ROOT_HASH,
    limit: int | None = None,
) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block index `start`, chained from `parent`.

    `limit` caps how many blocks are hashed; the partial block at the end is never hashed.
    """
    n_full = len(token_ids) // block_size
    if limit is not None:
        n_full = min(n_full, start + limit)
    hashes = []
    for b in range(start, n_full):
        parent = hash_block_tokens(parent, token_ids[b * block_size : (b + 1) * block_size])
        hashes.append(parent)
    return hashes
