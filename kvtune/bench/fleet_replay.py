"""Recorded engine /metrics replayed as a live engine (`kvtune bench fleet`'s pods): a recording's scrapes
in a loop, each at its recorded offset, the first loop in the recorded bytes and every later one with its
cumulative series (counters, histogram buckets, counts and sums) carried on from where the loop before left
them, so no counter ever falls (a falling counter reads as an engine restart to the operator). Gauges replay
as recorded. Pure: text in, bytes out; the server (fleet_replay_server.py) does the I/O.

A recording is the `docs/examples/*.prom` format: each scrape after a `# scraped_at UNIX_SECONDS` line,
comment lines before the first scrape being the recording's own header.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

SCRAPED_AT = "# scraped_at "
# the cumulative samples of each metric kind, by their suffix on the family's name
CUMULATIVE_SUFFIXES = {"counter": ("", "_total"), "histogram": ("_bucket", "_count", "_sum"),
                       "summary": ("_count", "_sum")}  # fmt: skip


@dataclass(frozen=True)
class Scrape:
    at: float  # when it was scraped (epoch seconds)
    text: str  # the /metrics body, as it was


def split_recording(text: str) -> list[Scrape]:
    """The scrapes of a recording, in order; text before the first `# scraped_at` line is its header."""
    scrapes: list[Scrape] = []
    at: float | None = None
    lines: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith(SCRAPED_AT):
            if at is not None:
                scrapes.append(Scrape(at, "".join(lines)))
            at, lines = float(line[len(SCRAPED_AT) :].strip()), []
        elif at is not None:
            lines.append(line)
    if at is not None:
        scrapes.append(Scrape(at, "".join(lines)))
    if not scrapes:
        raise ValueError("no `# scraped_at` line: not a recording of scrapes")
    if any(later.at < earlier.at for earlier, later in itertools.pairwise(scrapes)):
        raise ValueError("the scrapes are not in the order they were taken")
    return scrapes


def sample_parts(line: str) -> tuple[str, str, str] | None:
    """A sample line as (series, value, rest): the name with its labels, the value as written, and what
    follows it (a timestamp, the newline). None for a comment or a blank line. Label values may hold
    spaces, braces and escaped quotes, so the labels are scanned, not split."""
    stripped = line.rstrip("\r\n")
    if not stripped.strip() or stripped.lstrip().startswith("#"):
        return None
    end = 0
    brace = stripped.find("{")
    space = stripped.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        quoted, escaped = False, False
        for i in range(brace + 1, len(stripped)):
            char = stripped[i]
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quoted = not quoted
            elif char == "}" and not quoted:
                end = i + 1
                break
        else:
            raise ValueError(f"unterminated labels: {stripped[:200]}")
    else:
        end = space if space != -1 else len(stripped)
    series = stripped[:end]
    tail = stripped[end:]
    value = tail.split()[0] if tail.split() else ""
    if not value:
        raise ValueError(f"a sample without a value: {stripped[:200]}")
    after = tail[tail.index(value) + len(value) :]
    return series, value, after + line[len(stripped) :]


def metric_kinds(text: str) -> dict[str, str]:
    """Family name -> kind, from the `# TYPE` lines."""
    kinds: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 4 and words[0] == "#" and words[1] == "TYPE":
            kinds[words[2]] = words[3]
    return kinds


def is_cumulative(name: str, kinds: dict[str, str]) -> bool:
    """Whether a sample of this name only ever grows in a live process (a counter, or a histogram's or a
    summary's buckets, count and sum). A family named with or without `_total` (text format 0.0.4 or
    OpenMetrics) is found either way."""
    for kind, suffixes in CUMULATIVE_SUFFIXES.items():
        for suffix in suffixes:
            if suffix and not name.endswith(suffix):
                continue
            family = name[: len(name) - len(suffix)] if suffix else name
            if kinds.get(family) == kind:
                return True
    return name.endswith("_total") and kinds.get(name[: -len("_total")]) == "counter"


def go_float(value: float) -> str:
    """A value as the text format writes it (Go's spelling of the infinities and NaN)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


Piece = str | tuple[str, str, str]  # a literal chunk, or a cumulative sample (series, value as written, rest)


@dataclass(frozen=True)
class Replay:
    """One recording made ready to replay: its scrapes cut into literal text and cumulative samples, each
    cumulative series' values over the recording (made non-decreasing, as a live counter is) and how much
    it grows per loop."""

    name: str
    offsets: tuple[float, ...]  # each scrape's seconds after the first
    period: float  # one loop: the last offset and one mean gap more
    pieces: tuple[tuple[Piece, ...], ...]  # per scrape
    values: tuple[dict[str, float], ...]  # per scrape: series -> its value (never below an earlier one)
    growth: dict[str, float]  # series -> what one loop adds to it

    @property
    def scrapes(self) -> int:
        return len(self.offsets)

    def position(self, elapsed: float) -> tuple[int, int]:
        """(loop, scrape index) of the scrape that stands `elapsed` seconds into the replay."""
        loop, within = divmod(max(0.0, elapsed), self.period)
        index = max(0, bisect.bisect_right(self.offsets, within) - 1)
        return int(loop), index

    def value(self, series: str, loop: int, index: int) -> float | None:
        """The series' value at (loop, index), None where the recording's scrape lacks it."""
        found = self.values[index].get(series)
        return None if found is None else found + loop * self.growth[series]

    def render(self, loop: int, index: int) -> bytes:
        """Scrape `index` of loop `loop`: loop 0 byte for byte as recorded (a value made non-decreasing
        aside), later loops with every cumulative value carried on."""
        parts: list[str] = []
        values = self.values[index]
        for piece in self.pieces[index]:
            if isinstance(piece, str):
                parts.append(piece)
                continue
            series, written, rest = piece
            value = values[series] + loop * self.growth[series]
            unchanged = loop == 0 and value == float(written)
            parts.append(f"{series} {written if unchanged else go_float(value)}{rest}")
        return "".join(parts).encode()


def replay_of(name: str, text: str) -> Replay:
    """A recording's Replay. Each cumulative series grows per loop by its rise over the recording plus one
    mean step, so the first scrape of a loop stands one step above the last of the loop before."""
    scrapes = split_recording(text)
    kinds: dict[str, str] = {}
    for scrape in scrapes:
        kinds.update(metric_kinds(scrape.text))
    pieces: list[tuple[Piece, ...]] = []
    values: list[dict[str, float]] = []
    highest: dict[str, float] = {}
    seen: dict[str, list[float]] = {}
    for scrape in scrapes:
        chunk: list[str] = []
        cut: list[Piece] = []
        found: dict[str, float] = {}
        for line in scrape.text.splitlines(keepends=True):
            parts = sample_parts(line)
            name = parts[0].split("{", 1)[0] if parts else ""
            if parts is None or not is_cumulative(name, kinds):
                chunk.append(line)
                continue
            if chunk:
                cut.append("".join(chunk))
                chunk = []
            series, written, _ = parts
            value = max(float(written), highest.get(series, float("-inf")))
            highest[series] = value
            found[series] = value
            seen.setdefault(series, []).append(value)
            cut.append(parts)
        if chunk:
            cut.append("".join(chunk))
        pieces.append(tuple(cut))
        values.append(found)
    growth = {}
    for series, rise in seen.items():
        span = rise[-1] - rise[0]
        growth[series] = span + (span / (len(rise) - 1) if len(rise) > 1 else 0.0)
    offsets = tuple(scrape.at - scrapes[0].at for scrape in scrapes)
    gap = offsets[-1] / (len(offsets) - 1) if len(offsets) > 1 and offsets[-1] > 0 else 1.0
    return Replay(name, offsets, offsets[-1] + gap, tuple(pieces), tuple(values), growth)
