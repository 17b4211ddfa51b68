"""The choice of vLLM's admission flag: forced by the policy, else the flag the container already sets, else
the vLLM version (the engine's /version before the image tag), else --max-num-seqs; and the value written to
--max-num-active-seqs never above the container's --max-num-seqs (vLLM refuses to start otherwise)."""

from __future__ import annotations

import pytest

from kvtune.operator.decide.admission_flag import (
    MAX_NUM_ACTIVE_SEQS,
    MAX_NUM_SEQS,
    admission_value,
    choose_flag,
    container_device,
    image_tag,
    parse_version,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.32.0", (0, 32, 0)), ("v0.32.1", (0, 32, 1)), ("0.33.0rc1", (0, 33, 0)), ("0.11.2+cpu", (0, 11, 2)),
     ("1.0", (1, 0, 0)), ("latest", None), ("", None), (None, None)],
)  # fmt: skip
def test_versions_parse(text: str | None, expected: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == expected


def test_image_tags() -> None:
    assert image_tag("vllm/vllm-openai:v0.32.0") == "v0.32.0"
    assert image_tag("registry:5000/vllm/vllm-openai:v0.31.1@sha256:abc") == "v0.31.1"
    assert image_tag("registry:5000/vllm/vllm-openai") is None


def test_the_policy_forces_either_flag() -> None:
    old = ["--max-num-seqs", "64"]
    assert choose_flag("MaxNumActiveSeqs", old, "0.10.0", None).flag == MAX_NUM_ACTIVE_SEQS
    assert choose_flag("MaxNumSeqs", ["--max-num-active-seqs=8"], "0.32.0", None).flag == MAX_NUM_SEQS


def test_auto_prefers_the_flag_in_the_args_then_the_reported_version_then_the_tag() -> None:
    assert choose_flag("Auto", ["--max_num_active_seqs", "8"], None, None).flag == MAX_NUM_ACTIVE_SEQS
    reported_old = choose_flag("Auto", ["--max-num-seqs=64"], "0.31.2", "vllm/vllm-openai:v0.32.0")
    assert reported_old.flag == MAX_NUM_SEQS and "/version" in reported_old.why
    from_tag = choose_flag("Auto", ["--max-num-seqs=64"], None, "vllm/vllm-openai:v0.32.0")
    assert from_tag.flag == MAX_NUM_ACTIVE_SEQS and "image tag" in from_tag.why
    unknown = choose_flag("Auto", [], None, "vllm/vllm-openai:latest")
    assert unknown.flag == MAX_NUM_SEQS and "unknown" in unknown.why


def test_the_active_limit_stays_within_max_num_seqs() -> None:
    assert admission_value(MAX_NUM_ACTIVE_SEQS, 80, 64) == 64
    assert admission_value(MAX_NUM_ACTIVE_SEQS, 12, 64) == 12
    assert admission_value(MAX_NUM_ACTIVE_SEQS, 12, None) == 12
    assert admission_value(MAX_NUM_SEQS, 80, 64) == 80


def test_the_container_says_its_device_by_its_gpu_request_or_its_image() -> None:
    assert container_device(
        {"image": "vllm/vllm-openai:v0.32.0", "resources": {"requests": {"nvidia.com/gpu": 2}}}
    ) == (
        "cuda",
        "GPU request",
    )
    assert container_device({"image": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"}) == (
        "cpu",
        "image",
    )
    assert container_device(
        {"image": "vllm/vllm-openai:v0.32.0", "resources": {"limits": {"nvidia.com/gpu": "0"}}}
    ) == (
        None,
        None,
    )
