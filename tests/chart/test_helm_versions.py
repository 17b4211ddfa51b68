"""Helm 3 and Helm 4 read the chart alike: `helm lint --strict` passes with each, and every install of the
matrix renders, with each, exactly the objects the tests' own helm renders (a template function or a value
one Helm reads differently shows here, before a user's install does). Live installs: tests/e2e."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.helm import BASE_VALUES, CHART, helm, template
from tests.chart.helm_versions import MAJORS, require
from tests.chart.matrix import MATRIX


def objects(rendered: str) -> list[dict[str, Any]]:
    """The rendered objects, with the one value that differs on every render (the examples' generated admin
    tokens, `randAlphaNum`) blanked."""
    found = [doc for doc in yaml.safe_load_all(rendered) if doc]
    for obj in found:
        if obj["kind"] == "Secret" and "token" in obj.get("data", {}):
            obj["data"]["token"] = "<generated>"
    return found


@pytest.mark.parametrize("major", MAJORS)
def test_helm_lint_passes(major: str, tmp_path: Path) -> None:
    path, version = require(major)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(BASE_VALUES))
    done = helm("lint", "--strict", CHART, "-f", values, binary=path)
    assert done.returncode == 0, f"helm {version}: {done.stdout}{done.stderr}"
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("case", sorted(MATRIX))
@pytest.mark.parametrize("major", MAJORS)
def test_every_install_renders_the_same_objects(major: str, case: str, tmp_path: Path) -> None:
    path, version = require(major)
    values, api_versions = MATRIX[case]
    theirs = template(values, tmp_path, api_versions, binary=path)
    assert theirs.returncode == 0, f"helm {version}: {theirs.stderr}"
    ours = template(values, tmp_path, api_versions)
    assert ours.returncode == 0, ours.stderr
    assert objects(theirs.stdout) == objects(ours.stdout), f"helm {version} renders {case} differently"
