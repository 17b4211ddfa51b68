"""The README's install, policy and uninstall blocks (readme_blocks.py) are there, parse as shell, and say
what the chart needs: the install block's `helm install`, run as `helm template` with the README's REGISTRY
and the built release as RELEASE, renders the release it describes (the release's chart package, the image
from REGISTRY pinned by the release's digest, the namespace it watches, a Recommend ceiling);
its policy is the one the CRD accepts, in Recommend; the uninstall deletes the policies before the release
and never kopf's shared CRDs. The e2e run executes the same blocks against a real API server."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jsonschema
import yaml

from tests.chart.crd_schemas import chart_crds, closed
from tests.chart.helm import require_helm
from tests.chart.readme_blocks import BLOCKS, readme_block
from tests.chart.release_build import artifact, built_release, digest, version

REGISTRY = "registry.example.com/platform"


def test_every_block_parses_as_shell() -> None:
    for name in BLOCKS:
        done = subprocess.run(
            ["bash", "-n"], input=readme_block(name), capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, f"{name}: {done.stderr}"


def test_the_install_block_renders_the_release_it_describes(tmp_path: Path) -> None:
    block = readme_block("install").replace("\\\n", " ")
    (command,) = [line for line in block.splitlines() if line.strip().startswith("helm install")]
    # the words as a reader's shell makes them, with REGISTRY and RELEASE (the built release) set
    env = {**os.environ, "REGISTRY": REGISTRY, "RELEASE": str(built_release())}
    done = subprocess.run(["bash", "-euc", 'printf "%s\\0" ' + command.strip()], capture_output=True, text=True,
                          timeout=30, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    words = done.stdout.split("\0")[:-1]
    assert words[:2] == ["helm", "install"] and Path(words[3]) == artifact("chart"), words
    words = [require_helm(), "template", *words[2:]]
    done = subprocess.run(
        words, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2]
    )
    assert done.returncode == 0, done.stderr
    objects = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"{REGISTRY}/kvtune-operator:{version()}@{digest('operator')}"  # pinned
    args = container["args"]
    assert args[args.index("--max-mode") + 1] == "Recommend"
    assert args[args.index("--namespace") + 1] == "inference"


def test_the_policy_block_is_valid_and_recommends() -> None:
    block = readme_block("policy")
    manifest = block.split("<<'YAML'\n", 1)[1].split("\nYAML", 1)[0]
    policy = yaml.safe_load(manifest)
    schema = closed(chart_crds()[("kvtune.dev/v1alpha1", "KVTuningPolicy")])
    assert not [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(policy)]
    assert policy["spec"]["mode"] == "Recommend"


def test_the_uninstall_block_deletes_policies_first_and_no_shared_crd() -> None:
    lines = [line.split("#")[0].strip() for line in readme_block("uninstall").splitlines() if line.strip()]
    assert lines[0].startswith("kubectl delete kvtuningpolicies")
    assert lines[1].startswith("helm uninstall")
    assert not any("kopf" in line or "crds/" in line for line in lines)
