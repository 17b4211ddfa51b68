"""`kvtune dashboards build`: write dashboards/<uid>.json from the Python source (committed; a test fails on
drift), and the check that the committed files are what the source builds. The Helm chart holds its own copy
(charts/kvtune/files/dashboards/: helm cannot read files outside the chart's folder), written by the same
command and checked for drift the same way."""

from __future__ import annotations

from pathlib import Path

from kvtune.dashboards.grafana import dashboard_json, dashboard_uids

REBUILD_COMMAND = "kvtune dashboards build"


def rendered() -> dict[str, str]:
    """File name -> the JSON text the source builds now."""
    return {f"{uid}.json": dashboard_json(uid) for uid in dashboard_uids()}


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered().items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return written


def drift(directory: Path) -> list[str]:
    """Names of the files in `directory` that differ from (or are missing against) what the source builds."""
    return [
        name
        for name, text in rendered().items()
        if not (directory / name).is_file() or (directory / name).read_text() != text
    ]
