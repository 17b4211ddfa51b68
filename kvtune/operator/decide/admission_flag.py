"""Which vLLM flag the operator lowers to bound admission: `--max-num-active-seqs` where the engine's vLLM
has it (0.32 and later: it caps how many requests run, without shrinking the model runner or recapturing
CUDA graphs), else `--max-num-seqs`, which every version has. Pure: the caller brings the container's
arguments, its image and the version the engine reported, if any.

vLLM refuses `--max-num-active-seqs` above `--max-num-seqs`, so `admission_value` bounds the value written
by the `--max-num-seqs` the container already sets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

AdmissionFlagChoice = Literal["Auto", "MaxNumActiveSeqs", "MaxNumSeqs"]
MAX_NUM_SEQS = "--max-num-seqs"
MAX_NUM_ACTIVE_SEQS = "--max-num-active-seqs"
FIRST_WITH_ACTIVE_SEQS = (0, 32)
FORCED = {"MaxNumActiveSeqs": MAX_NUM_ACTIVE_SEQS, "MaxNumSeqs": MAX_NUM_SEQS}
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class FlagChoice:
    flag: str  # MAX_NUM_SEQS or MAX_NUM_ACTIVE_SEQS
    why: str  # one phrase, for Events, status and the doctor


def parse_version(text: str | None) -> tuple[int, int, int] | None:
    """(major, minor, patch) from `0.32.0`, `v0.32.1`, `0.32.0rc1`, `0.11.0+cpu`; None when it is not one."""
    match = _VERSION.match((text or "").strip())
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def image_tag(image: str | None) -> str | None:
    """The tag of an image reference (`vllm/vllm-openai:v0.32.0` -> `v0.32.0`; a registry port is not one)."""
    name = (image or "").split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


GPU_RESOURCES = ("nvidia.com/gpu",)


def container_device(container: dict[str, object]) -> tuple[str | None, str | None]:
    """Where a vLLM container runs, from its pod spec, and what said so: "cuda" with a GPU in its resources,
    "cpu" where its image says so (vLLM's CPU images do), None where neither does. The doctor and the
    operator read it alike, so both round a recommendation the same way (`default_round_to`)."""
    resources = container.get("resources")
    resources = resources if isinstance(resources, dict) else {}
    asked = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    if any(str(asked.get(kind, "0")) not in ("0", "") for kind in GPU_RESOURCES):
        return "cuda", "GPU request"
    if "cpu" in str(container.get("image", "")).lower():
        return "cpu", "image"
    return None, None


def has_flag(args: list[str], flag: str) -> bool:
    spellings = (flag, "--" + flag[2:].replace("-", "_"))
    return any(arg.partition("=")[0] in spellings for arg in args)


def choose_flag(
    choice: AdmissionFlagChoice, args: list[str], reported_version: str | None, image: str | None
) -> FlagChoice:
    """The policy's forced flag; in Auto, the admission flag the container already sets, else what the
    vLLM version has (the engine's own /version first, then the image tag), else `--max-num-seqs`."""
    if choice != "Auto":
        return FlagChoice(FORCED[choice], f"forced by the policy (admissionFlag {choice})")
    if has_flag(args, MAX_NUM_ACTIVE_SEQS):
        return FlagChoice(MAX_NUM_ACTIVE_SEQS, "already in the container's args")
    for source, text in (("the engine's /version", reported_version), ("the image tag", image_tag(image))):
        version = parse_version(text)
        if version is not None:
            has_it = version[:2] >= FIRST_WITH_ACTIVE_SEQS
            flag = MAX_NUM_ACTIVE_SEQS if has_it else MAX_NUM_SEQS
            return FlagChoice(
                flag, f"vLLM {text} from {source} {'has' if has_it else 'lacks'} {MAX_NUM_ACTIVE_SEQS}"
            )
    return FlagChoice(MAX_NUM_SEQS, "vLLM version unknown: every version has --max-num-seqs")


def admission_value(flag: str, value: int, max_num_seqs: int | None) -> int:
    """The value to write: `--max-num-active-seqs` never above the container's `--max-num-seqs` (vLLM
    refuses to start otherwise); `--max-num-seqs` as asked."""
    if flag == MAX_NUM_ACTIVE_SEQS and max_num_seqs is not None:
        return min(value, max_num_seqs)
    return value
