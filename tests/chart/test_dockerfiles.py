"""The images cannot be built on these machines, so their Dockerfiles are checked for what would break a
build or a start: every path they COPY exists in the repository (the build context is its root), each
image's ENTRYPOINT + CMD is a kvtune verb that runs, both run as a numeric non-root user, and the chart's
default images are the names the README documents."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.chart.helm import CHART, REPO

DOCKERFILES = sorted((REPO / "deploy" / "docker").glob("*.Dockerfile"))


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments), with continuation lines joined and comments dropped."""
    joined = dockerfile.read_text().replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def exec_form(arguments: str) -> list[str]:
    parsed = json.loads(arguments)
    assert isinstance(parsed, list) and all(isinstance(item, str) for item in parsed), arguments
    return parsed


def test_there_is_an_operator_and_an_engine_image() -> None:
    assert [path.name for path in DOCKERFILES] == ["engine.Dockerfile", "operator.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[path.stem for path in DOCKERFILES])
def test_every_copied_path_exists(dockerfile: Path) -> None:
    copies = [args for keyword, args in instructions(dockerfile) if keyword in ("COPY", "ADD")]
    assert copies
    for args in copies:
        words = [word for word in shlex.split(args) if not word.startswith("--")]
        if any(word.startswith("--from=") for word in shlex.split(args)):
            continue  # from an earlier build stage, not the repository
        for source in words[:-1]:
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: not in the repository"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[path.stem for path in DOCKERFILES])
def test_the_entrypoint_is_a_kvtune_verb_that_runs(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    (entrypoint,) = [exec_form(args) for keyword, args in steps if keyword == "ENTRYPOINT"]
    (command,) = [exec_form(args) for keyword, args in steps if keyword == "CMD"]
    assert entrypoint == ["kvtune"]
    kvtune = Path(sys.executable).parent / "kvtune"
    done = subprocess.run([str(kvtune), *command, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{dockerfile.name}: kvtune {' '.join(command)} --help: {done.stderr}"
    assert f"usage: kvtune {command[0]}" in done.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[path.stem for path in DOCKERFILES])
def test_the_image_runs_as_a_numeric_non_root_user(dockerfile: Path) -> None:
    users = [args for keyword, args in instructions(dockerfile) if keyword == "USER"]
    user, _, group = users[-1].partition(":")
    assert user.isdigit() and int(user) != 0 and (not group or (group.isdigit() and int(group) != 0))


def test_the_operator_image_installs_no_torch() -> None:
    runs = " ".join(
        args for keyword, args in instructions(REPO / "deploy/docker/operator.Dockerfile") if keyword == "RUN"
    )
    assert "'.[operator]'" in runs and "torch" not in runs and "engine" not in runs


def test_the_charts_default_images_are_the_ones_the_readme_documents() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (REPO / "README.md").read_text()
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for image in (values["image"], values["examples"]["kvtuneEngine"]["image"]):
        assert image["tag"] == ""  # the chart's appVersion
        assert f"{image['repository']}:{app_version}" in readme
