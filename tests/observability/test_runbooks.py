"""The runbooks (docs/runbooks/): every alert's runbook_url resolves to its page in this repository, at this
release's tag, and the page has the four headings on-call reads (Meaning, Impact, Diagnosis, Mitigation);
the index lists every alert with its severity; and the table of Event reasons is the set the operator's
code posts, no more, no less."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvtune import __version__
from kvtune.observability import command, rules
from tests.observability.event_reasons import event_reasons_in_code

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "docs" / "runbooks"
HEADINGS = ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation")
REPOSITORY = "https://github.com/kvtune/kvtune/blob/"


def rendered_alerts() -> list[dict[str, object]]:
    groups = yaml.safe_load((ROOT / "deploy" / "prometheus" / command.RULES_FILE).read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def page_of(url: str) -> Path:
    """The file in this repository a runbook_url names (`.../blob/<ref>/<path>`)."""
    assert url.startswith(REPOSITORY), url
    ref, _, path = url.removeprefix(REPOSITORY).partition("/")
    assert ref == f"v{__version__}", f"{url}: not this release's tag"
    return ROOT / path


def test_every_runbook_url_resolves_to_a_page_with_the_four_headings() -> None:
    alerts = rendered_alerts()
    assert len(alerts) == len(rules.alert_rules() + rules.operator_alert_rules())
    for alert in alerts:
        url = str(alert["annotations"]["runbook_url"])  # type: ignore[index]
        page = page_of(url)
        assert page.is_file(), f"{alert['alert']}: {url} names {page}, which is not in the repository"
        text = page.read_text()
        assert text.startswith(f"# {alert['alert']}\n"), page
        assert f"**Severity: {alert['labels']['severity']}" in text, page  # type: ignore[index]
        for heading in HEADINGS:
            assert heading in text, f"{page.name} lacks {heading}"


def test_no_page_is_left_without_its_alert_and_the_index_lists_each_with_its_severity() -> None:
    alerts = {str(a["alert"]): a["labels"]["severity"] for a in rendered_alerts()}  # type: ignore[index]
    pages = {path.stem for path in RUNBOOKS.glob("*.md")} - {"README"}
    assert pages == set(alerts)
    index = (RUNBOOKS / "README.md").read_text()
    for alert, severity in alerts.items():
        assert f"| `{alert}` | {severity} |" in index, alert


def test_the_event_reasons_table_is_the_set_the_code_posts() -> None:
    index = (RUNBOOKS / "README.md").read_text()
    table = index.split("## Event reasons", 1)[1]
    documented = set(re.findall(r"^\| `(\w+)` \| (Normal|Warning) \|", table, re.MULTILINE))
    in_code = event_reasons_in_code()
    assert len(in_code) >= 16, in_code  # the patterns above still find them
    assert documented == in_code, f"undocumented: {in_code - documented}; not posted: {documented - in_code}"
