"""Linking torch's family from kvtune's venv into vLLM's: the files are shared, pip finds them installed."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from kvtune.bench.venv_links import link_distributions, site_packages_distributions, torch_family
from kvtune.bench.vllm_cpu import pinned_torch_version


def _install_fake(site: Path, name: str, version: str, module: str) -> None:
    """A distribution as pip leaves it: a package, a dist-info with RECORD, and a console script in bin/."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(f"VERSION = {version!r}\n")
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    record = [f"{module}/__init__.py,,", f"{info.name}/METADATA,,", f"{info.name}/INSTALLER,,"]
    record += [f"../../../bin/{module}-run,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")


@pytest.fixture
def source_site(tmp_path: Path) -> Path:
    site = tmp_path / "source" / "lib" / "python3" / "site-packages"
    site.mkdir(parents=True)
    _install_fake(site, "torch", "2.13.0", "torch")
    _install_fake(site, "nvidia-cublas", "13.1.1.3", "nvidia_cublas")
    _install_fake(site, "triton", "3.7.1", "triton")
    _install_fake(site, "numpy", "2.3.0", "numpy")
    bin_dir = tmp_path / "source" / "bin"
    bin_dir.mkdir()
    (bin_dir / "torch-run").write_text("#!/source/bin/python\n")
    return site


def test_the_family_is_torch_and_its_cuda_wheels_at_the_pinned_version_only(source_site: Path) -> None:
    installed = site_packages_distributions(source_site)
    assert torch_family(installed, "2.13.0") == ["nvidia-cublas", "torch", "triton"]
    assert torch_family(installed, "2.12.0") == []
    assert torch_family({}, "2.13.0") == []


def test_the_pin_is_read_from_vllms_requirements() -> None:
    assert pinned_torch_version(["numpy", "torch==2.13.0", "transformers>=5"]) == "2.13.0"
    assert pinned_torch_version(["torch>=2.10"]) is None


def test_linked_files_share_inodes_and_scripts_in_bin_stay_behind(source_site: Path, tmp_path: Path) -> None:
    target = tmp_path / "target" / "site-packages"
    report = link_distributions(source_site, target, ["torch", "nvidia-cublas"])
    assert report.linked == 2 * 4 and report.copied == 0
    for relative in ("torch/__init__.py", "nvidia_cublas/__init__.py", "torch-2.13.0.dist-info/RECORD"):
        assert os.stat(source_site / relative).st_ino == os.stat(target / relative).st_ino
    assert not (target / "numpy").exists()
    assert not list(tmp_path.glob("target/**/torch-run"))
    assert {name: d.version for name, d in site_packages_distributions(target).items()} == {
        "torch": "2.13.0",
        "nvidia-cublas": "13.1.1.3",
    }


def test_removing_a_linked_file_in_the_target_leaves_the_source_whole(
    source_site: Path, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    link_distributions(source_site, target, ["torch"])
    (target / "torch" / "__init__.py").unlink()
    assert (source_site / "torch" / "__init__.py").read_text() == "VERSION = '2.13.0'\n"


def test_pip_in_the_target_venv_finds_the_linked_torch_installed(source_site: Path, tmp_path: Path) -> None:
    """What the sharing is for: pip resolves vLLM's `torch==X` to the linked copy, downloading nothing."""
    env_dir = tmp_path / "vllm-venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    link_distributions(source_site, Path(purelib), ["torch", "nvidia-cublas", "triton"])
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps"]
    done = subprocess.run(
        [*pip, "torch==2.13.0", "triton==3.7.1"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Requirement already satisfied: torch==2.13.0" in done.stdout
    missing = subprocess.run([*pip, "torch==2.12.0"], capture_output=True, text=True, check=False)
    assert missing.returncode != 0, "a torch of another version must not count as installed"
    assert sysconfig.get_paths()["purelib"] != purelib
