"""The README's install, policy and uninstall commands as the e2e tests run them: each shell block marked
`<!-- e2e:NAME -->` in the README, verbatim. The e2e run (tests/e2e, on the local control plane) runs them
in order with REGISTRY set, as a reader would after building and pushing the image."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = ("install", "policy", "uninstall")


def readme_block(name: str) -> str:
    """The shell block right after `<!-- e2e:NAME -->` in the README."""
    text = README.read_text()
    found = re.search(rf"<!-- e2e:{re.escape(name)} -->\n```sh\n(.*?)```", text, re.S)
    assert found, f"README.md has no shell block marked <!-- e2e:{name} -->"
    return found.group(1)
