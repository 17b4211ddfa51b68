"""Fingerprints of token-id sequences for the prefix-defeat detector: cheap, O(tokens), stdlib only.

Three kinds, each answering one question about a prompt against earlier ones:
- token-level prefix hashes (the first few hundred tokens): how long is the exact common prefix?
- k-gram anchors: which runs of content recur, at whatever offset? Positions are picked by their first
  token (content-defined), so two prompts sharing a run pick the same anchors in it whatever precedes it.
- a stable short hex digest, the only form in which a prompt's identity leaves the detector.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# A 32-bit odd multiplier (Knuth's) to spread token ids before the anchor test: the most frequent tokens of a
# real vocabulary sit at low ids, and `id % s` alone would pick or skip them all together.
_MIX = 2654435761


def prefix_hashes(token_ids: Sequence[int], length: int) -> list[int]:
    """`out[i]` identifies `token_ids[:i + 1]`, for the first `length` tokens (chained like block hashes).

    Python's hash of a tuple of ints does not depend on the process (no hash randomisation), so the values
    are comparable across prompts and runs."""
    out: list[int] = []
    h = 0
    for token in token_ids[:length]:
        h = hash((h, token))
        out.append(h)
    return out


def kgram_anchors(token_ids: Sequence[int], k: int, sample: int, dense_prefix: int) -> list[tuple[int, int]]:
    """(position, hash) of the k-grams kept as anchors: every position below `dense_prefix`, and beyond it
    the positions whose first token falls in the `1/sample` share picked by a fixed mix of its id.

    Dense anchors at the head make the start of a shared run exact where varying spans usually lie
    (timestamps, ids, user names); sampled ones keep long documents cheap to remember. Hashes are of the
    k-gram's bytes, so they are only comparable inside one process, which is all the detector needs."""
    n = len(token_ids) - k + 1
    if n <= 0:
        return []
    buf = array("I", [t & 0xFFFFFFFF for t in token_ids]).tobytes()
    width = 4 * k
    dense = min(dense_prefix, n)
    anchors = [(i, hash(buf[4 * i : 4 * i + width])) for i in range(dense)]
    anchors.extend(
        (i, hash(buf[4 * i : 4 * i + width]))
        for i in range(dense, n)
        if ((token_ids[i] * _MIX) >> 13) % sample == 0
    )
    return anchors


def is_sampled_anchor(token_id: int, sample: int) -> bool:
    """Whether a k-gram starting with `token_id` is an anchor beyond the dense head (see `kgram_anchors`)."""
    return ((token_id * _MIX) >> 13) % sample == 0


def stable_digest(token_ids: Sequence[int], start: int = 0, stop: int | None = None) -> str:
    """A short hex digest of `token_ids[start:stop]`, the same in every process: a prompt's or a shared
    run's identity in reports, never its text."""
    part = token_ids[start:stop]
    return hashlib.blake2b(array("I", [t & 0xFFFFFFFF for t in part]).tobytes(), digest_size=8).hexdigest()
