"""The bench's workload catalog: every load a `kvtune bench` verb runs, named, in one place.

A `Workload` is a closed loop against one engine: the KV pool it runs in, the load (`LoadShape`), the too-high
max_num_seqs a tuner starts at and the static values swept around the optimum. The tuner and what-if benchmarks
read the same catalog: three named workloads at different pool-to-footprint ratios, issue 28's, and seeded random
ones. A workload given by flags is named for what it is (`from_flags`). A `Burst` is the other kind of load: a
batch sent at once (`kvtune bench engine`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any

from kvtune.harness.load import LoadShape

RANDOM_SEED = 28  # issue 28's three seeded random workloads


@dataclass(frozen=True)
class Workload:
    """A named closed-loop workload: the pool, the load, where the tuner starts, and a sweep around its optimum."""

    name: str
    kv_cache_tokens: int
    load: LoadShape
    start: int
    sweep: tuple[int, ...]
    why: str = ""

    @property
    def footprint(self) -> float:
        """A request's mean full length, prompt + output, in tokens."""
        return sum(self.load.prompt_len) / 2 + sum(self.load.output_len) / 2

    @property
    def ratio(self) -> float:
        """Pool ÷ mean footprint: about how many requests at their full length the pool holds."""
        return self.kv_cache_tokens / self.footprint

    @property
    def prompt_share(self) -> float:
        return sum(self.load.prompt_len) / 2 / self.footprint

    def describe(self) -> str:
        load = self.load
        return (
            f"pool {self.kv_cache_tokens:,}, {load.clients} clients, prompts {span_text(load.prompt_len)}, "
            f"outputs {span_text(load.output_len)} (pool ÷ mean footprint {self.ratio:.1f}, "
            f"prompt share {self.prompt_share:.0%})"
        )

    def record(self) -> dict[str, Any]:
        """The workload as a what-if result stores it (flat, as results were stored before the catalog)."""
        return {"name": self.name, "kv_cache_tokens": self.kv_cache_tokens, "clients": self.load.clients,
                "prompt_len": list(self.load.prompt_len), "output_len": list(self.load.output_len),
                "start": self.start, "sweep": list(self.sweep)}  # fmt: skip

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Workload:
        """A workload read back from a stored result (`record`)."""
        load = LoadShape(int(data["clients"]), span(data["prompt_len"]), span(data["output_len"]))
        return cls(str(data["name"]), int(data["kv_cache_tokens"]), load, int(data["start"]),
                   tuple(int(v) for v in data["sweep"]), str(data.get("why", "")))  # fmt: skip


def span(value: str | list[int] | tuple[int, ...]) -> tuple[int, int]:
    """`LO:HI` (a flag) or a stored pair, as a pair of ints."""
    low, high = (int(v) for v in (value.split(":") if isinstance(value, str) else value))
    return low, high


def span_text(pair: tuple[int, int]) -> str:
    return f"{pair[0]}:{pair[1]}"


def _named(name: str, pool: int, clients: int, prompt: tuple[int, int], output: tuple[int, int], start: int,
           sweep: tuple[int, ...], why: str) -> Workload:  # fmt: skip
    return Workload(name, pool, LoadShape(clients, prompt, output), start, sweep, why)


# Three pool-to-footprint ratios (pool / mean full footprint about 9, 13 and 4.6): the tuner must converge on
# each, not on one workload it was tuned against; and issue 28's, one the tuner had not seen.
NAMED = {
    w.name: w
    for w in (
        _named("default", 4096, 16, (200, 400), (100, 200), 64, (4, 6, 7, 8, 9, 10, 12, 16),
               "the benchmark's first workload"),
        _named("wide-prompts", 6144, 24, (150, 450), (80, 240), 48, (8, 10, 11, 12, 13, 14, 16),
               "issue 15's workload: a larger pool, prompts spread three to one"),
        _named("long-outputs", 2048, 8, (100, 300), (150, 350), 32, (2, 3, 4, 5, 6, 8),
               "a pool of few requests whose outputs outgrow their prompts"),
        _named("issue-28", 10240, 40, (600, 1400), (40, 400), 96, (4, 6, 8, 10, 12, 14, 16, 20),
               "issue 28's workload, one the tuner had not seen"),
    )
}  # fmt: skip
TUNER_FIRST = ("default", "wide-prompts", "long-outputs")  # the tuner benchmark's own three, before issue 28


def random_workloads(seed: int = RANDOM_SEED, count: int = 3) -> list[Workload]:
    """`count` seeded workloads spread over pool ÷ mean footprint 3 to 20 (one per equal slice of that
    range, in log scale) and over prompt shares from output-heavy (0.2) to prompt-heavy (0.8), each slice
    of both ranges used once, paired at random. Clients over-subscribe the pool by half; the sweep spans
    0.4-1.6× the pool's mean-footprint capacity; the start is twice the clients."""
    rng = random.Random(seed)
    ratio_slices = [(3 * (20 / 3) ** (i / count), 3 * (20 / 3) ** ((i + 1) / count)) for i in range(count)]
    share_slices = [(0.2 + 0.6 * i / count, 0.2 + 0.6 * (i + 1) / count) for i in range(count)]
    rng.shuffle(share_slices)
    found = []
    for i, ((r_low, r_high), (s_low, s_high)) in enumerate(zip(ratio_slices, share_slices, strict=True)):
        ratio = math.exp(rng.uniform(math.log(r_low), math.log(r_high)))
        share = rng.uniform(s_low, s_high)
        footprint = rng.uniform(300, 900)
        prompt, output = share * footprint, (1 - share) * footprint
        spread = rng.uniform(0.3, 0.6)  # each length uniform on mean × (1 ± spread)
        prompt_len = (max(1, round(prompt * (1 - spread))), round(prompt * (1 + spread)))
        output_len = (max(1, round(output * (1 - spread))), round(output * (1 + spread)))
        pool = max(16, round(ratio * footprint / 16) * 16)
        pool = max(pool, (prompt_len[1] + output_len[1] + 32) // 16 * 16)
        capacity = pool / (sum(prompt_len) / 2 + sum(output_len) / 2)
        clients = max(4, math.ceil(1.5 * capacity))
        sweep = sorted({max(1, round(capacity * f)) for f in (0.4, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25, 1.6)})
        w = Workload(f"random-{seed}-{i + 1}", pool, LoadShape(clients, prompt_len, output_len), 2 * clients,
                     tuple(sweep))  # fmt: skip
        found.append(replace(w, why=f"seeded random workload (seed {seed}): {w.describe()}"))
    return found


def catalog(seed: int = RANDOM_SEED) -> dict[str, Workload]:
    """Every named workload and the seeded random ones (pool ÷ mean footprint spread over 3-20, prompt-heavy to
    output-heavy), by name: what the tuner and what-if benchmarks choose from."""
    return {**NAMED, **{w.name: w for w in random_workloads(seed)}}


def flags_name(kv_cache_tokens: int, load: LoadShape) -> str:
    """The name of a workload given by flags: what it is, spelled from its pool and load."""
    prompt, output = load.prompt_len, load.output_len
    return (
        f"pool-{kv_cache_tokens}-clients-{load.clients}-prompts-{prompt[0]}-{prompt[1]}"
        f"-outputs-{output[0]}-{output[1]}"
    )


def from_flags(
    preset: Workload,
    kv_cache_tokens: int | None = None,
    clients: int | None = None,
    prompt_len: str | None = None,
    output_len: str | None = None,
    start: int | None = None,
    sweep: str | None = None,
) -> Workload:
    """`preset` with the flags given (None: left unset) put over it. A workload whose pool or load differs from
    the preset's is another workload, named from its flags (`flags_name`); a new start or sweep keeps the name
    (the same workload, measured from elsewhere)."""
    pool = preset.kv_cache_tokens if kv_cache_tokens is None else kv_cache_tokens
    load = replace(
        preset.load,
        clients=preset.load.clients if clients is None else clients,
        prompt_len=preset.load.prompt_len if prompt_len is None else span(prompt_len),
        output_len=preset.load.output_len if output_len is None else span(output_len),
    )
    values = preset.sweep if sweep is None else tuple(int(v) for v in sweep.split(","))
    chosen = replace(preset, kv_cache_tokens=pool, load=load, sweep=values,
                     start=preset.start if start is None else start)  # fmt: skip
    if (pool, load) == (preset.kv_cache_tokens, preset.load):
        return chosen
    return replace(chosen, name=flags_name(pool, load), why=f"given by flags: {chosen.describe()}")


@dataclass(frozen=True)
class Burst:
    """A batch sent all at once, and the pool it runs in (`kvtune bench engine`), unless a flag says otherwise."""

    num_requests: int
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    kv_cache_tokens: int = 32_768
    block_size: int = 32
    max_num_seqs: int = 64


# A burst of 96 long requests (the comparison issue 17 asked for): 96 requests at once, prompts 300-700,
# outputs 500-1,500 with ignore_eos, a 32,768-token pool, block 32, max_num_seqs 64.
BURST96_LONG = Burst(num_requests=96, prompt_tokens=(300, 700), output_tokens=(500, 1500))
# The small model costs ~270 MFLOP a token (~60x the tiny one): the batch (~48,000 prompt and
# ~96,000 output tokens, ~39 TFLOP) would take an estimated ~10 minutes a run on 2 AVX2 cores, most of an
# hour for two rounds, so its default batch is a third as many requests with a fifth of the output (~6
# TFLOP), the same for both servers. `--workload burst96-long` runs the long burst on it anyway.
SMALL_DEFAULT = Burst(num_requests=32, prompt_tokens=(300, 700), output_tokens=(100, 300))
