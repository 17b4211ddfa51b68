"""Where the doctor finds vLLM's max_num_seqs beyond its metrics (vLLM's log, the pod's container args,
vLLM's own default where the doctor knows it), and how it rounds: as the operator for the same engine
and device (`default_round_to`, the function KVTuningPolicy's unset roundTo resolves through)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtune.operator.decide.sample import Sample
from kvtune.operator.doctor.engine_config import (
    config_from_pod,
    config_from_vllm_log,
    engine_of,
    flag_value,
    round_to_for,
    unknown_limit,
)
from kvtune.operator.k8s.crd import KVTuningPolicySpec

# vLLM 0.32.0's CPU build, as it logged its start (lines cut to the fields that matter)
NON_DEFAULT = (
    "(APIServer pid=4839) INFO 12-06 23:03:23 [api_utils.py:286] non-default args: {'host': '127.0.0.1', "
    "'port': 60159, 'model': '/tmp/tiny', 'dtype': 'float32', 'max_model_len': 4096, 'served_model_name': "
    "['tiny'], 'block_size': 32, 'kv_cache_memory_bytes': 8454144, 'max_num_seqs': 8}"
)
ENGINE = (
    "(EngineCore pid=4852) INFO 12-06 23:03:30 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with "
    "config: model='/tmp/tiny', speculative_config=None, dtype=torch.float32, max_seq_len=4096, "
    "tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, kv_cache_dtype=auto, "
    "device_config=cpu, seed=0, compilation_config={'level': 0, 'mode': None}"
)


def log(*lines: str) -> str:
    return "\n".join(["$ python -m vllm.entrypoints.openai.api_server --model /tmp/tiny", *lines, ""])


def test_vllm_log_gives_the_flag_the_device_and_the_version() -> None:
    found = config_from_vllm_log(log(NON_DEFAULT, ENGINE))
    assert (found.max_num_seqs, found.device, found.vllm_version, found.max_model_len) == (
        8,
        "cpu",
        "0.32.0",
        4096,
    )
    assert found.max_num_seqs_from == "--max-num-seqs in vLLM's log" and found.missing is None


def test_vllm_log_prefers_the_active_limit_and_the_last_boot() -> None:
    active = NON_DEFAULT.replace("'max_num_seqs': 8}", "'max_num_seqs': 64, 'max_num_active_seqs': 24}")
    found = config_from_vllm_log(log(NON_DEFAULT, ENGINE, active, ENGINE))
    assert (found.max_num_seqs, found.max_num_seqs_from) == (24, "--max-num-active-seqs in vLLM's log")


def test_vllm_log_without_the_flag_uses_the_cpu_default_per_rank() -> None:
    unset = NON_DEFAULT.replace(", 'max_num_seqs': 8}", "}")
    found = config_from_vllm_log(
        log(unset, ENGINE.replace("tensor_parallel_size=1", "tensor_parallel_size=2"))
    )
    assert found.max_num_seqs == 256  # vLLM 0.32 on CPU: 128 per rank
    assert found.max_num_seqs_from == "vLLM 0.32.0's default on cpu (vLLM's log sets no --max-num-seqs)"


def test_vllm_log_without_the_flag_on_a_gpu_says_which_flag_to_pass() -> None:
    unset = NON_DEFAULT.replace(", 'max_num_seqs': 8}", "}")
    found = config_from_vllm_log(log(unset, ENGINE.replace("device_config=cpu", "device_config=cuda")))
    assert found.max_num_seqs is None and found.device == "cuda"
    assert found.missing is not None and found.missing.endswith(
        "pass --max-num-seqs N (the value the engine runs with)"
    )


def test_throughput_mode_doubles_a_default_the_doctor_does_not_guess() -> None:
    unset = NON_DEFAULT.replace(", 'max_num_seqs': 8}", ", 'performance_mode': 'throughput'}")
    assert config_from_vllm_log(log(unset, ENGINE)).max_num_seqs is None


def test_a_log_that_is_not_vllms_is_refused() -> None:
    with pytest.raises(ValueError, match="neither vLLM's `non-default args` line nor its engine config line"):
        config_from_vllm_log("INFO: Uvicorn running on http://0.0.0.0:8000\n")


def pod(*containers: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "inference", "name": "llama-0"},
        "spec": {"containers": list(containers)},
    }


VLLM_GPU = {
    "name": "vllm",
    "image": "vllm/vllm-openai:v0.31.2",
    "args": ["--model", "meta-llama/Llama-3.1-8B", "--max-num-seqs=96", "--max-model-len", "8192"],
    "resources": {"limits": {"nvidia.com/gpu": "1"}},
}
SIDECAR = {
    "name": "proxy",
    "image": "kvtune/proxy:0.1.0",
    "args": ["proxy", "--upstream", "http://127.0.0.1:8000"],
}


def test_pod_args_give_the_flag_the_gpu_and_the_version() -> None:
    found = config_from_pod(pod(SIDECAR, VLLM_GPU))
    assert (found.max_num_seqs, found.device, found.vllm_version, found.max_model_len) == (
        96,
        "cuda",
        "v0.31.2",
        8192,
    )
    assert found.max_num_seqs_from == "--max-num-seqs in pod inference/llama-0 container vllm"


def test_pod_command_form_and_underscore_spelling() -> None:
    production_stack = {"name": "engine", "image": "lmcache/vllm-openai:latest",
                        "command": ["vllm", "serve", "m", "--max_num_active_seqs", "40", "--max-num-seqs", "128"]}  # fmt: skip
    assert config_from_pod(pod(production_stack)).max_num_seqs == 40


def test_pod_without_the_flag_on_a_gpu_says_which_flag_to_pass() -> None:
    unset = {**VLLM_GPU, "args": ["--model", "m"]}
    found = config_from_pod(pod(unset))
    assert found.max_num_seqs is None
    assert found.missing == (
        "pod inference/llama-0 container vllm sets no --max-num-seqs and vLLM v0.31.2 on cuda has a default the "
        "doctor cannot tell; pass --max-num-seqs N (the value the engine runs with)"
    )


def test_pod_container_choice() -> None:
    with pytest.raises(ValueError, match="pass --container"):
        config_from_pod(pod(VLLM_GPU, {**VLLM_GPU, "name": "vllm-2"}))
    with pytest.raises(ValueError, match="no container 'engine' \\(it has vllm\\)"):
        config_from_pod(pod(VLLM_GPU), "engine")
    assert (
        config_from_pod(
            pod(VLLM_GPU, {**VLLM_GPU, "name": "b", "args": ["--max-num-seqs", "7"]}), "b"
        ).max_num_seqs
        == 7
    )


def test_flag_value_spellings() -> None:
    assert flag_value(["--max-num-seqs", "12"], "--max-num-seqs") == 12
    assert flag_value(["--max_num_seqs=13"], "--max-num-seqs") == 13
    assert flag_value(["--max-num-seqs"], "--max-num-seqs") is None
    assert flag_value(["--max-num-seqs-x", "3"], "--max-num-seqs") is None


@pytest.mark.parametrize(
    ("engine", "device", "expected"),
    [("vllm", None, 8), ("vllm", "cuda", 8), ("vllm", "cpu", 1), ("kvtune", None, 1), ("sglang", None, 1)],
)
def test_rounding_is_the_operators(engine: str, device: str | None, expected: int) -> None:
    assert round_to_for(engine, device)[0] == expected


def test_unknown_device_rounds_as_a_policy_with_roundto_unset() -> None:
    """A vLLM whose device the doctor cannot see rounds as a KVTuningPolicy for engine vllm without roundTo."""
    spec = KVTuningPolicySpec.model_validate(
        {"target": {"kind": "Deployment", "name": "v", "engine": "vllm"},
         "metrics": {"metricsUrl": "http://v:8000/metrics"}}
    )  # fmt: skip
    assert round_to_for("vllm", None)[0] == spec.to_policy().round_to == 8


def test_engine_of_a_sample() -> None:
    assert engine_of(Sample(0.0, gauges={"max_num_seqs": 8.0})) == "kvtune"
    assert engine_of(Sample(0.0, gauges={"retracted_now": 0.0})) == "sglang"
    assert engine_of(Sample(0.0, gauges={"running": 3.0})) == "vllm"


def test_the_one_line_names_the_flag() -> None:
    line = unknown_limit("vllm", ["--vllm-log"])
    assert "\n" not in line and "pass --max-num-seqs N" in line and "(--vllm-log)" in line
