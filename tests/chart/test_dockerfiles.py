"""The Dockerfiles cannot be built on these machines (no Docker engine; scripts/build_image.sh builds the
operator and proxy images without one, see docs/install.md), so they are checked for what would break a
build or a start: every path they COPY exists in the repository (the build context is its root), each
image's ENTRYPOINT + CMD is a kvtune verb that runs, every one runs as a numeric non-root user, the operator
and proxy images hold no torch, and the install page documents every image and both ways to build it."""

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


def test_there_is_an_operator_a_proxy_and_an_engine_image() -> None:
    assert [path.name for path in DOCKERFILES] == [
        "engine.Dockerfile",
        "operator.Dockerfile",
        "proxy.Dockerfile",
    ]


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


@pytest.mark.parametrize("kind", ["operator", "proxy"])
def test_the_operator_and_proxy_images_install_no_torch(kind: str) -> None:
    runs = " ".join(
        args for keyword, args in instructions(REPO / f"deploy/docker/{kind}.Dockerfile") if keyword == "RUN"
    )
    assert f"'.[{kind}]'" in runs and "torch" not in runs and "engine" not in runs


def test_the_install_page_documents_every_image_and_how_to_build_it() -> None:
    page = (REPO / "docs" / "install.md").read_text()
    script = (REPO / "scripts" / "build_image.sh").read_text()
    (kinds,) = [line.split(")")[0].split("|") for line in script.splitlines() if "operator | proxy)" in line]
    for dockerfile in DOCKERFILES:
        assert f"deploy/docker/{dockerfile.name}" in page, dockerfile.name
    for kind in (k.strip() for k in kinds):
        assert f"scripts/build_image.sh {kind}" in page, kind
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # no default image: nothing publishes one, and the install fails naming the value instead
    assert (
        values["image"]["repository"] == ""
        and values["examples"]["kvtuneEngine"]["image"]["repository"] == ""
    )
    assert values["examples"]["vllmProxy"]["proxyImage"]["repository"] == ""


def test_the_image_build_script_parses_and_refuses_an_unknown_kind() -> None:
    script = REPO / "scripts" / "build_image.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    done = subprocess.run(["bash", str(script), "engine"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and done.stderr.startswith("usage: ") and "operator|proxy" in done.stderr
