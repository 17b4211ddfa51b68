"""Install PyPI's `vllm-router` into a venv of its own (`make router-tools` puts it in .venv-router).

PyPI's `vllm-router` is vllm-project/router, the Rust router (a compiled extension with a Python launcher),
not production-stack's Python router of the same name (that one is not published to any registry these
machines reach). The layout test runs it in front of two kvtune engines, as a router stands in front of its
engines in a cluster. It pins its own aiohttp, fastapi and uvicorn, so it never shares kvtune's venv.
Running this again is a no-op once the pinned version is installed and its launcher imports. Standard
library only.

usage: python scripts/install_vllm_router.py [VENV_DIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

REQUIREMENT = "vllm-router==0.1.17"
DEFAULT_VENV = Path(__file__).resolve().parents[1] / ".venv-router"
STAMP = "kvtune-router-stamp.json"
LAUNCHER = "vllm_router.launch_router"


def python_of(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def is_installed(venv_dir: Path) -> bool:
    """The pinned requirement is what the stamp says was installed, and its launcher imports."""
    try:
        stamp = json.loads((venv_dir / STAMP).read_text())
    except (OSError, ValueError):
        return False
    if stamp != {"requirement": REQUIREMENT}:
        return False
    probe = [str(python_of(venv_dir)), "-c", f"import {LAUNCHER}"]
    return subprocess.run(probe, capture_output=True, timeout=120).returncode == 0


def install(venv_dir: Path) -> None:
    if is_installed(venv_dir):
        print(f"{REQUIREMENT} already in {venv_dir}")
        return
    venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    pip = [str(python_of(venv_dir)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, REQUIREMENT], check=True, timeout=900)
    (venv_dir / STAMP).write_text(json.dumps({"requirement": REQUIREMENT}))
    if not is_installed(venv_dir):
        raise SystemExit(f"{REQUIREMENT} installed into {venv_dir}, but `import {LAUNCHER}` fails there")
    print(f"installed {REQUIREMENT} into {venv_dir}")


if __name__ == "__main__":
    install(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_VENV)
