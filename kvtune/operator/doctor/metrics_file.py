"""`kvtune doctor --metrics-file FILE`: saved `/metrics` scrapes read as the doctor's samples, so the doctor
runs on what someone recorded (or on docs/examples/) without an engine or a network.

A file holds one scrape (`curl -s URL/metrics > FILE`) or several, each after a marker line
`# scraped_at UNIX_SECONDS` (the line Prometheus' text format treats as a comment). A scrape's time is its
marker's, else the file's modification time. Every problem (a missing file, a body that is not Prometheus
text, a marker that is not a time, scrapes out of order, no series the doctor reads) is one KvtuneError line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from kvtune.errors import KvtuneError
from kvtune.operator.decide.sample import NoData, Sample, sample_from_series
from kvtune.operator.io.sources import exposition_series

MARKER = "# scraped_at"
_MARKER_LINE = re.compile(r"^# scraped_at[ \t]+(\S+)[ \t]*$", re.MULTILINE)


def split_scrapes(text: str, default_time: float) -> list[tuple[float, str]]:
    """(time, exposition text) per scrape: the text before the first marker is a scrape of its own only
    when it holds more than comments (a file's header, or a single unmarked scrape at `default_time`)."""
    markers = list(_MARKER_LINE.finditer(text))
    head = text[: markers[0].start()] if markers else text
    scrapes: list[tuple[float, str]] = []
    if any(line.strip() and not line.startswith("#") for line in head.splitlines()):
        scrapes.append((default_time, head))
    for index, marker in enumerate(markers):
        try:
            at = float(marker.group(1))
        except ValueError:
            raise KvtuneError(f"{marker.group(0)!r} is not `{MARKER} UNIX_SECONDS`") from None
        end = markers[index + 1].start() if index + 1 < len(markers) else len(text)
        scrapes.append((at, text[marker.end() : end]))
    return scrapes


def samples_of(text: str, default_time: float, source: str) -> list[Sample]:
    """Each scrape of one file's text as a Sample (pure: the caller reads the file)."""
    scrapes = split_scrapes(text, default_time)
    if not scrapes:
        raise KvtuneError(f"{source}: no metrics in it (a saved /metrics, e.g. curl -s URL/metrics > FILE)")
    samples: list[Sample] = []
    for number, (at, body) in enumerate(scrapes, 1):
        where = source if len(scrapes) == 1 else f"{source} (scrape {number} of {len(scrapes)})"
        try:
            series = exposition_series(body)
        except ValueError as err:
            raise KvtuneError(f"{where}: not Prometheus text: {err}") from None
        found = sample_from_series(series, at, source)
        if isinstance(found, NoData):
            raise KvtuneError(f"{where}: {found.reason}")
        samples.append(found)
    return samples


def read_metrics_files(paths: Sequence[str]) -> list[Sample]:
    """Every scrape of every file, in the order given; each scrape later than the one before it."""
    samples: list[Sample] = []
    for name in paths:
        path = Path(name)
        try:
            text = path.read_text(encoding="utf-8")
            modified = path.stat().st_mtime
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise KvtuneError(f"--metrics-file {name}: {reason}") from None
        samples.extend(samples_of(text, modified, name))
    for before, after in pairwise(samples):
        if after.timestamp <= before.timestamp:
            raise KvtuneError(
                f"--metrics-file: the scrapes are not in time order ({before.timestamp:.3f} then "
                f"{after.timestamp:.3f}); give files oldest first, each scrape after its own `{MARKER}` line"
            )
    return samples


def snapshot_note(samples: Sequence[Sample]) -> str | None:
    """What one scrape cannot tell, said once in the report; None for a window of several scrapes."""
    if len(samples) != 1:
        return None
    return (
        "one scrape: its counters count since the engine started and its gauges hold one instant, so the "
        "figures are since boot, not a window, and there is no what-if table (its fit needs 3 scrapes over "
        f"5 s: save several, each after a `{MARKER} $(date +%s)` line)"
    )
