"""What the doctor learns of an engine's configuration beyond its metrics, and from where: vLLM's admission
limit (its metrics do not carry max_num_seqs, up to 0.32 at least), its device and version, from the
pod's container args or from vLLM's own startup log. Pure: the callers read the pod and the log.

The admission limit in force is `--max-num-active-seqs` where it is set, else `--max-num-seqs`, else
vLLM's default where the doctor knows it for that version and device (read from vLLM 0.32's
`EngineArgs.get_batch_defaults`: 128 per tensor x pipeline rank on CPU; on a GPU it depends on the
GPU's memory, which neither the log nor the pod says, so the doctor asks for the flag)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

from kvtune.contract import metrics as m
from kvtune.core.objectives import default_round_to
from kvtune.operator.decide.admission_flag import (
    MAX_NUM_ACTIVE_SEQS,
    MAX_NUM_SEQS,
    container_device,
    image_tag,
    parse_version,
)
from kvtune.operator.decide.sample import Sample

KVTUNE, SGLANG, VLLM = "kvtune", "sglang", "vllm"
SGLANG_GAUGES = (m.RETRACTED_NOW, m.CACHE_HIT_RATE_GAUGE)  # series only SGLang exports
CPU_DEFAULT_PER_RANK = {(0, 32): 128}  # vLLM (major, minor) -> its API server's default on CPU, per rank
ASK = "pass --max-num-seqs N (the value the engine runs with)"

_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$", re.MULTILINE)
_ENGINE_LINE = re.compile(r"Initializing a V1 LLM engine \(v([^)\s]+)\) with config: (.*)$", re.MULTILINE)
_CONFIG_FIELD = r"(?:^|, ){name}=([^,]+)"


@dataclass(frozen=True)
class EngineConfig:
    """Beyond the metrics: the admission limit and where it was read, the device, the vLLM version; `missing`
    says in one line why the limit is unknown and which flag gives it."""

    max_num_seqs: int | None = None
    max_num_seqs_from: str | None = None
    device: str | None = None  # "cpu" or "cuda", where something said so
    device_from: str | None = None
    vllm_version: str | None = None
    version_from: str = ""
    max_model_len: int | None = None
    missing: str | None = None


def engine_of(sample: Sample | None) -> str:
    """Which engine a sample came from: kvtune exports its live max_num_seqs, SGLang its own gauges;
    everything else the doctor reads is vLLM."""
    if sample is None:
        return VLLM
    if m.MAX_NUM_SEQS in sample.gauges:
        return KVTUNE
    if any(name in sample.gauges for name in SGLANG_GAUGES):
        return SGLANG
    return VLLM


def round_to_for(engine: str, device: str | None) -> tuple[int, str]:
    """The operator's rounding for this engine and device (`default_round_to`, which KVTuningPolicy's
    unset roundTo resolves through), and why; a vLLM whose device is unknown is taken to run on CUDA, as
    the operator takes it."""
    accelerator = device or ("cuda" if engine == VLLM else "cpu")
    value = default_round_to(engine, accelerator)
    if engine != VLLM:
        return value, f"{engine}: any value"
    if device is None:
        return (
            value,
            "vLLM, device unknown: CUDA assumed, as the operator does (--round-to 1 on vLLM's CPU build)",
        )
    if accelerator == "cuda":
        return value, "vLLM on CUDA: its CUDA graphs"
    return value, f"vLLM on {accelerator}: no CUDA graphs (a KVTuningPolicy for it sets roundTo: 1)"


def default_max_num_seqs(version: str | None, device: str | None, world_size: int) -> int | None:
    """vLLM's own default where the doctor has read it for this version and device; None elsewhere."""
    parsed = parse_version(version)
    if parsed is None or device != "cpu":
        return None
    per_rank = CPU_DEFAULT_PER_RANK.get(parsed[:2])
    return per_rank * world_size if per_rank is not None else None


def _limit(
    active: int | None, seqs: int | None, version: str | None, device: str | None, world: int, where: str
) -> tuple[int | None, str | None, str | None]:
    """(value, where it came from, why it is missing) from what a source sets."""
    if active is not None:
        return active, f"{MAX_NUM_ACTIVE_SEQS} in {where}", None
    if seqs is not None:
        return seqs, f"{MAX_NUM_SEQS} in {where}", None
    default = default_max_num_seqs(version, device, world)
    if default is not None:
        return default, f"vLLM {version}'s default on {device} ({where} sets no {MAX_NUM_SEQS})", None
    known = f"vLLM {version}" if version else "vLLM (version unknown)"
    on = f" on {device}" if device else ""
    return (
        None,
        None,
        f"{where} sets no {MAX_NUM_SEQS} and {known}{on} has a default the doctor cannot tell; {ASK}",
    )


# ---- vLLM's startup log -----------------------------------------------------------------------------------


def _non_default_args(text: str) -> dict[str, Any]:
    """The last boot's `non-default args: {...}` line (a Python dict literal), {} when absent."""
    found = _NON_DEFAULT.findall(text)
    if not found:
        return {}
    try:
        args = ast.literal_eval(found[-1])
    except (ValueError, SyntaxError):
        return {}
    return args if isinstance(args, dict) else {}


def _int(value: object) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def config_from_vllm_log(text: str, where: str = "vLLM's log") -> EngineConfig:
    """The last boot in a vLLM log: its non-default args (vLLM logs only the flags set) and its engine
    config line (version, `device_config`, `max_seq_len`, parallel sizes)."""
    args = _non_default_args(text)
    engines = _ENGINE_LINE.findall(text)
    version, config = engines[-1] if engines else (None, "")

    def field(name: str) -> str | None:
        hit = re.search(_CONFIG_FIELD.format(name=re.escape(name)), config)
        return hit.group(1).strip() if hit else None

    if not args and not engines:
        raise ValueError(f"{where} holds neither vLLM's `non-default args` line nor its engine config line")
    device = field("device_config")
    world = (_int(field("tensor_parallel_size")) or 1) * (_int(field("pipeline_parallel_size")) or 1)
    seqs = _int(args["max_num_seqs"]) if "max_num_seqs" in args else None
    active = _int(args["max_num_active_seqs"]) if "max_num_active_seqs" in args else None
    if seqs is None and args.get("performance_mode") == "throughput":
        version = None  # vLLM doubles its default in throughput mode: the doctor does not guess it
    value, source, missing = _limit(active, seqs, version, device, world, where)
    return EngineConfig(
        max_num_seqs=value,
        max_num_seqs_from=source,
        device=device,
        device_from=where if device else None,
        vllm_version=version,
        version_from="its log",
        max_model_len=_int(args.get("max_model_len")) or _int(field("max_seq_len")),
        missing=missing,
    )


# ---- a pod's spec -----------------------------------------------------------------------------------------


def flag_value(words: list[str], flag: str) -> int | None:
    """A flag's integer in an argument list (`--flag N` or `--flag=N`, dashes or underscores)."""
    names = (flag, "--" + flag[2:].replace("-", "_"))
    for index, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in names:
            text = value if eq else (words[index + 1] if index + 1 < len(words) else "")
            return _int(text)
    return None


def _words(container: dict[str, Any]) -> list[str]:
    return [str(word) for word in (container.get("command") or []) + (container.get("args") or [])]


def vllm_container(pod: dict[str, Any], name: str | None) -> dict[str, Any]:
    """The container named `name`, else the one that runs vLLM (its image, command or args say so), else
    the pod's only container."""
    containers: list[dict[str, Any]] = pod.get("spec", {}).get("containers") or []
    if name is not None:
        chosen = [c for c in containers if c.get("name") == name]
        if not chosen:
            names = ", ".join(str(c.get("name")) for c in containers)
            raise ValueError(f"the pod has no container {name!r} (it has {names or 'none'})")
        return chosen[0]
    running = [c for c in containers if "vllm" in " ".join([str(c.get("image", "")), *_words(c)]).lower()]
    if len(running) == 1 or (not running and len(containers) == 1):
        return (running or containers)[0]
    names = ", ".join(str(c.get("name")) for c in containers)
    raise ValueError(f"which container runs vLLM? pass --container (the pod has {names or 'none'})")


def config_from_pod(pod: dict[str, Any], container_name: str | None = None) -> EngineConfig:
    """The vLLM container's flags (command and args, as the operator reads them), its device (a GPU in its
    resources) and its version (the image tag)."""
    container = vllm_container(pod, container_name)
    metadata = pod.get("metadata", {})
    where = (
        f"pod {metadata.get('namespace', '')}/{metadata.get('name', '')} container {container.get('name')}"
    )
    words = _words(container)
    device, said = container_device(container)
    tag = image_tag(container.get("image"))
    version = tag if parse_version(tag) is not None else None
    world = (flag_value(words, "--tensor-parallel-size") or 1) * (
        flag_value(words, "--pipeline-parallel-size") or 1
    )
    active = flag_value(words, MAX_NUM_ACTIVE_SEQS)
    value, source, missing = _limit(active, flag_value(words, MAX_NUM_SEQS), version, device, world, where)
    return EngineConfig(
        max_num_seqs=value,
        max_num_seqs_from=source,
        device=device,
        device_from=f"{where}'s {said}" if said else None,
        vllm_version=version,
        version_from="the pod's image tag",
        max_model_len=flag_value(words, "--max-model-len"),
        missing=missing,
    )


def unknown_limit(engine: str, looked: list[str]) -> str:
    """The one line the doctor prints when nothing gave max_num_seqs."""
    if engine != VLLM:
        return f"the engine's max_num_seqs is unknown; {ASK}"
    where = f" ({', '.join(looked)})" if looked else ""
    return (
        f"vLLM's /metrics do not carry max_num_seqs{where}: {ASK}, or --vllm-log FILE "
        "(kubectl logs POD > FILE), or --pod NAMESPACE/NAME"
    )
