"""One vLLM, one recommendation: the doctor on the recorded real vLLM (docs/examples) and the operator's
tuner on the same scrapes, with a KVTuningPolicy for that engine, recommend the same max_num_seqs, because
both round through `default_round_to` and plan through `kvtune.core.predict.plan` with the policy's
objective (`objective_of`) and bounds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtune.cli import main
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.operator.decide.ladder import Remedy
from kvtune.operator.decide.loop import live_view
from kvtune.operator.decide.ports import ActuatorResult
from kvtune.operator.decide.tuner import TunerState, decide
from kvtune.operator.decide.window import Window
from kvtune.operator.doctor.metrics_file import read_metrics_files
from kvtune.operator.k8s.crd import KVTuningPolicySpec
from tests.operator.recorded_metrics import RECORDED, RECORDED_LOG

IN_FORCE = 64  # the recorded vLLM's --max-num-seqs (its log says so)


def operator_recommends(spec_fields: dict[str, Any]) -> tuple[int, int]:
    """(recommended max_num_seqs, round_to) of the tuner's first evaluation of the recorded window, as
    the operator sees a vLLM Deployment whose args set --max-num-seqs 64."""
    spec = KVTuningPolicySpec.model_validate(
        {"target": {"kind": "Deployment", "name": "vllm", "engine": "vllm"},
         "metrics": {"metricsUrl": "http://vllm:8000/metrics"}, "mode": "Recommend", **spec_fields}
    )  # fmt: skip
    policy = spec.to_policy()
    samples = read_metrics_files([str(RECORDED)])
    engine = live_view(
        samples[-1], frozenset({KNOB_MAX_NUM_SEQS}), ActuatorResult(True, {KNOB_MAX_NUM_SEQS: IN_FORCE})
    )
    decision, _ = decide(Window.of(samples), engine, policy, TunerState(), samples[-1].timestamp)
    predicted = [a for a in decision.advice if a.remedy is Remedy.PREDICT_MAX_NUM_SEQS]
    assert predicted, decision.note
    assert isinstance(predicted[0].recommended, int)
    return predicted[0].recommended, policy.round_to


def doctor_recommends(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, int]:
    assert main(["doctor", "--metrics-file", str(RECORDED), "--json", *flags]) == 0
    what_if = json.loads(capsys.readouterr().out)["what_if"]
    return what_if["recommended"], what_if["round_to"]


def test_device_unknown_the_doctor_recommends_what_a_default_vllm_policy_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doctor = doctor_recommends(capsys, "--max-num-seqs", str(IN_FORCE))
    assert doctor == operator_recommends({})
    assert doctor[1] == 8 and doctor[0] % 8 == 0


def test_on_cpu_the_doctor_recommends_what_a_cpu_vllm_policy_does(capsys: pytest.CaptureFixture[str]) -> None:
    doctor = doctor_recommends(capsys, "--vllm-log", str(RECORDED_LOG))
    assert doctor == operator_recommends({"roundTo": 1})
    assert doctor[1] == 1
