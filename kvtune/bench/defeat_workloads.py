"""Labelled prefix-defeat workloads: the evaluation set of `kvtune bench prefix-defeats`.

Each request is (key, token ids after the chat template, cache_salt, expected reason or None). Prompts are
built from parts the generator chose (a template header, a system prompt, a timestamp, a retrieved document, a
user turn), so it knows where the shared content lies; whether a request is a defeat is then decided exactly,
with unbounded memory, against everything sent earlier under its key (`_Truth`). The detector under test has
bounded, hashed memory and sees only token ids.

Realism over convenience: token ids follow a Zipf law over a 32k vocabulary (natural text repeats common
tokens, so short k-grams recur by chance), every prompt starts with its key's 4-6 token chat-template header
and separates turns with template tokens, timestamps advance with the request clock (consecutive ones share
the date and differ in the last digits), user names repeat, keys are interleaved, lengths vary.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvtune.core.prefix_defeats import leading_hits
from kvtune.core.prefix_hash import prompt_block_hashes, salted_root

VOCAB = 32_000
ZIPF_EXPONENT = 1.05
_SPECIAL = VOCAB  # template tokens live above the text vocabulary, as added tokens do
_DIGITS = 15  # ids of "0".."99" chunks start here (number tokens sit low in real vocabularies)

# Which requests need a shared run this long to count as a defeat (the same floor the detector states).
MIN_SHARED_TOKENS = 32

FAMILY_KINDS = (
    "clean",
    "clean_salted",
    "unrelated",
    "timestamp",
    "request_id",
    "user_name",
    "rag",
    "short_prefix",
    "salted",
)
# How often each kind sends a request (relative weights).
_KIND_WEIGHTS = {
    "clean": 22,
    "clean_salted": 6,
    "unrelated": 12,
    "timestamp": 10,
    "request_id": 8,
    "user_name": 8,
    "rag": 14,
    "short_prefix": 10,
    "salted": 10,
}
_FAMILY_REASON = {
    "timestamp": "varying_head",
    "request_id": "varying_head",
    "user_name": "varying_head",
    "rag": "misaligned",
}


@dataclass(frozen=True)
class LabelledRequest:
    key: str
    token_ids: tuple[int, ...]
    cache_salt: str | None
    expected: str | None  # the reason a perfect detector reports, or None
    kind: str  # the family kind it came from (FAMILY_KINDS)
    cached_tokens: int | None = None  # engine mode: what an LRU prefix cache of limited size served


class _Zipf:
    """Token ids with Zipf-distributed frequencies (rank r has weight r^-s; rank 0 is id 100)."""

    def __init__(self, vocab: int = VOCAB, exponent: float = ZIPF_EXPONENT) -> None:
        self.ids = range(100, 100 + vocab - 100)
        self.cum = list(itertools.accumulate(1.0 / (r + 1) ** exponent for r in range(len(self.ids))))

    def draw(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.ids, cum_weights=self.cum, k=n)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


@dataclass
class _Built:
    ids: list[int]
    salt: str | None
    shared: tuple[int, int] | None  # [start, end) of the family's shared run in this prompt
    run_id: str | None  # names the shared run (family, document), to know whether it was sent before


class _Family:
    """One source of related requests under a key: a system prompt, a document pool, a naming scheme."""

    def __init__(self, kind: str, name: str, key: _Key, rng: random.Random, zipf: _Zipf) -> None:
        self.kind, self.name, self.key, self.zipf = kind, name, key, zipf
        b = key.block_size
        if kind in ("clean", "clean_salted", "salted"):
            self.system = zipf.draw(rng, _log_uniform(rng, b, 1500))
        elif kind in ("timestamp", "request_id", "user_name"):
            self.intro = zipf.draw(rng, rng.randint(0, 12))  # e.g. "You are a helpful assistant. Today is"
            self.label = zipf.draw(rng, rng.randint(1, 4))
            self.system = zipf.draw(rng, _log_uniform(rng, 48, 2000))
            self.names = [zipf.draw(rng, rng.randint(1, 3)) for _ in range(40)]
        elif kind == "rag":
            self.instruction = zipf.draw(rng, rng.randint(0, 60))
            self.docs = [zipf.draw(rng, _log_uniform(rng, 150, 1500)) for _ in range(rng.randint(2, 6))]
        elif kind == "short_prefix":
            # A short system prompt: with the header and the turn separator, usually under one block.
            self.system = zipf.draw(rng, rng.randint(1, max(1, b - len(key.header) - len(key.separator) - 1)))
        self.tenant_salt = f"tenant-{name}"

    def build(self, rng: random.Random, clock: float, serial: int) -> _Built:
        k, z = self.key, self.zipf
        user = z.draw(rng, _log_uniform(rng, 8, 300))
        if self.kind in ("clean", "clean_salted", "short_prefix", "salted"):
            ids = [*k.header, *self.system, *k.separator, *user]
            shared_end = len(k.header) + len(self.system) + len(k.separator)
            salt = None
            if self.kind == "clean_salted":
                salt = self.tenant_salt
            elif self.kind == "salted":
                salt = f"req-{serial:08x}-{rng.getrandbits(32):08x}"
                if rng.random() < 0.5:
                    ids = [*k.header, *self.system, *k.separator, *self.system[:8]]  # an identical prompt
            return _Built(ids, salt, (0, shared_end), self.name)
        if self.kind == "unrelated":
            return _Built([*k.header, *z.draw(rng, _log_uniform(rng, 20, 800))], None, None, None)
        if self.kind == "rag":
            doc_index = min(int(rng.paretovariate(1.2)) - 1, len(self.docs) - 1)  # popular documents first
            preamble = z.draw(rng, _log_uniform(rng, 16, 400))  # retrieved snippets, history: varies
            head = [*k.header, *self.instruction, *preamble]
            ids = [*head, *self.docs[doc_index], *k.separator, *user]
            return _Built(
                ids, None, (len(head), len(head) + len(self.docs[doc_index])), f"{self.name}/{doc_index}"
            )
        head = [*k.header, *self.intro, *self.label, *self._varying(rng, clock, serial)]
        ids = [*head, *self.system, *k.separator, *user]
        return _Built(ids, None, (len(head), len(head) + len(self.system) + len(k.separator)), self.name)

    def _varying(self, rng: random.Random, clock: float, serial: int) -> list[int]:
        if self.kind == "timestamp":  # "2026-12-01 14:05:33" as number chunks and separators
            t = int(clock)
            day, rest = divmod(t, 86_400)
            hour, rest = divmod(rest, 3600)
            minute, second = divmod(rest, 60)
            dash, colon = 13, 14
            return [_DIGITS + 20, _DIGITS + 26, dash, _DIGITS + 12, dash, _DIGITS + 1 + day % 28, _DIGITS + hour, colon, _DIGITS + minute, colon, _DIGITS + second]  # fmt: skip
        if self.kind == "request_id":  # a UUID: hex chunks of one or two characters
            return [rng.randrange(_DIGITS, _DIGITS + 300) for _ in range(rng.randint(14, 22))]
        weights = [1.0 / (i + 1) for i in range(len(self.names))]  # a few users send most requests
        return list(rng.choices(self.names, weights=weights)[0])


@dataclass
class _Key:
    name: str
    block_size: int
    header: list[int]
    separator: list[int]


class _Truth:
    """What a perfect detector reports: exact, unbounded memory of everything sent earlier under each key."""

    def __init__(self, block_size: int, engine_cache_blocks: int | None) -> None:
        self.b = block_size
        self.blocks: dict[str, set[int]] = {}
        self.prefixes: dict[str, set[tuple[int, ...]]] = {}
        self.runs: dict[str, set[str]] = {}
        self.cache_blocks = engine_cache_blocks
        self.cache: OrderedDict[int, None] = OrderedDict()  # the engine's LRU prefix cache, all keys

    def label(self, key: str, kind: str, built: _Built) -> tuple[str | None, int | None]:
        b, ids = self.b, built.ids
        seen = self.blocks.setdefault(key, set())
        prefixes = self.prefixes.setdefault(key, set())
        runs = self.runs.setdefault(key, set())
        max_hit = (len(ids) - 1) // b
        plain = prompt_block_hashes(ids, b, limit=max_hit)
        salted = (
            plain
            if built.salt is None
            else prompt_block_hashes(ids, b, parent=salted_root(built.salt), limit=max_hit)
        )
        ideal = leading_hits(salted, seen)
        full_plain = prompt_block_hashes(ids, b)
        full_salted = (
            full_plain if built.salt is None else prompt_block_hashes(ids, b, parent=salted_root(built.salt))
        )
        cached = None
        if self.cache_blocks is not None:
            cached = leading_hits(salted, self.cache) * b
            for h in full_salted:
                self.cache[h] = None
                self.cache.move_to_end(h)
            while len(self.cache) > self.cache_blocks:
                self.cache.popitem(last=False)
        lcp = max((i for i in range(1, min(len(ids), b) + 1) if tuple(ids[:i]) in prefixes), default=0)
        expected = self._expected(kind, built, ideal, leading_hits(plain, seen), lcp, cached, runs)
        seen.update(full_plain)
        seen.update(full_salted)
        prefixes.update(tuple(ids[:i]) for i in range(1, min(len(ids), b) + 1))
        if built.run_id is not None:
            runs.add(built.run_id)
        return expected, cached

    def _expected(
        self, kind: str, built: _Built, ideal: int, content: int, lcp: int, cached: int | None, runs: set[str]
    ) -> str | None:
        b, n = self.b, len(built.ids)
        if cached is not None and cached < ideal * b:
            return "evicted"
        if built.salt is not None and content > ideal:
            return "salted"
        reason = _FAMILY_REASON.get(kind)
        if reason and built.shared and built.run_id in runs:
            start, end = built.shared
            if end - max(start, ideal * b) >= max(2 * b, MIN_SHARED_TOKENS):
                return reason
        if content == 0 and max(8, b // 2) <= lcp < min(b, n):
            return "shorter_than_block"
        return None


def generate(
    seed: int,
    requests: int,
    block_size: int,
    keys: int = 4,
    engine_cache_blocks: int | None = None,
) -> Iterator[LabelledRequest]:
    """`requests` labelled requests, the same for the same arguments. With `engine_cache_blocks`, each request
    also carries the hit an LRU prefix cache of that many blocks (one engine, all keys) served, and requests
    whose blocks it had evicted are labelled `evicted`."""
    rng = random.Random(seed)
    zipf = _Zipf()
    key_list = [
        _Key(
            f"key-{i}",
            block_size,
            header=[_SPECIAL + rng.randrange(64) for _ in range(rng.randint(4, 6))],
            separator=[_SPECIAL + rng.randrange(64) for _ in range(rng.randint(3, 5))],
        )
        for i in range(keys)
    ]
    families = [
        _Family(kind, f"{k.name}/{kind}/{j}", k, rng, zipf)
        for k in key_list
        for kind in FAMILY_KINDS
        for j in range(2 if kind in ("clean", "rag") else 1)
    ]
    weights = [_KIND_WEIGHTS[f.kind] for f in families]
    truth = _Truth(block_size, engine_cache_blocks)
    clock = 1_796_000_000.0  # seconds; requests arrive about every 1.5 s
    for serial in range(requests):
        family = rng.choices(families, weights=weights)[0]
        clock += rng.expovariate(1 / 1.5)
        built = family.build(rng, clock, serial)
        expected, cached = truth.label(family.key.name, family.kind, built)
        yield LabelledRequest(family.key.name, tuple(built.ids), built.salt, expected, family.kind, cached)
