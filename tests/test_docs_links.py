"""The README and the pages under docs/ link to files that exist, and to headings those files have: the
README was split into docs/ pages (0.1.0), and a link that points nowhere is how such a move goes wrong."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    found = {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    return found | set(re.findall(r'<a id="([^"]+)">', text))


def test_every_relative_link_resolves_to_a_file_and_a_heading() -> None:
    broken = []
    for page in PAGES:
        in_code = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(line):
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                path, _, anchor = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}:{number}: {target}"
                if not file.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                    broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)
