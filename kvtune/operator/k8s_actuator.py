"""Change max_num_seqs of a vLLM or SGLang engine by patching its Deployment's container args: a rolling
restart, because neither engine can change it at run time.

The patch is a JSON merge patch carrying the resourceVersion that was read, so the API server refuses it
(409 Conflict) when someone else changed the Deployment meanwhile; then it is read again and re-applied, a
bounded number of times. Like every Actuator, failures are returned, never raised.
"""

from __future__ import annotations

import copy
from typing import Any

from kvtune.operator.actuators import ActuatorResult
from kvtune.operator.engine_view import KNOB_MAX_NUM_SEQS
from kvtune.operator.kube_api import KubeApi, KubeError, deployment_path

# the engine flag that bounds concurrently running requests
FLAGS = {"vllm": "--max-num-seqs", "sglang": "--max-running-requests"}
CONFLICT_RETRIES = 5


def _spellings(flag: str) -> tuple[str, str]:
    return flag, "--" + flag[2:].replace("-", "_")


def read_flag(args: list[str], flag: str) -> int | None:
    """The flag's integer value in an argument list (`--flag N` or `--flag=N`, dashes or underscores)."""
    names = _spellings(flag)
    for index, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names:
            text = value if eq else (args[index + 1] if index + 1 < len(args) else "")
            try:
                return int(text)
            except ValueError:
                return None
    return None


def set_flag(args: list[str], flag: str, value: int) -> list[str]:
    """The argument list with the flag set to `value`: replaced in place in whichever form it had,
    appended as `--flag N` when absent."""
    names = _spellings(flag)
    out = list(args)
    for index, arg in enumerate(out):
        name, eq, _ = arg.partition("=")
        if name in names:
            if eq:
                out[index] = f"{name}={value}"
            elif index + 1 < len(out):
                out[index + 1] = str(value)
            else:
                out.append(str(value))
            return out
    return [*out, flag, str(value)]


class DeploymentArgsActuator:
    """max_num_seqs through one container's args in a Deployment."""

    knobs = frozenset({KNOB_MAX_NUM_SEQS})

    def __init__(
        self, api: KubeApi, namespace: str, deployment: str, container: str | None, engine: str
    ) -> None:
        if engine not in FLAGS:
            raise ValueError(f"no Deployment-args actuator for engine {engine!r}")
        self.api = api
        self.path = deployment_path(namespace, deployment)
        self.where = f"deployment {namespace}/{deployment}"
        self.container = container
        self.flag = FLAGS[engine]

    def _container(self, deployment: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []
        for index, container in enumerate(containers):
            if self.container is None or container.get("name") == self.container:
                return index, container
        raise KubeError(404, "ContainerNotFound", f"{self.where} has no container {self.container!r}")

    def _value(self, container: dict[str, Any]) -> int | None:
        args = [str(a) for a in container.get("args") or []]
        found = read_flag(args, self.flag)
        return (
            found
            if found is not None
            else read_flag([str(a) for a in container.get("command") or []], self.flag)
        )

    def current(self) -> ActuatorResult:
        try:
            _, container = self._container(self.api.get(self.path))
        except KubeError as err:
            return ActuatorResult(False, {}, f"{self.where}: {err}")
        return ActuatorResult(True, {KNOB_MAX_NUM_SEQS: self._value(container)})

    def apply(self, knob: str, value: int | str | None) -> ActuatorResult:
        if knob != KNOB_MAX_NUM_SEQS:
            return ActuatorResult(False, {}, f"a Deployment patch here changes only max_num_seqs, not {knob}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return ActuatorResult(False, {}, f"max_num_seqs must be a positive integer, got {value!r}")
        for _ in range(CONFLICT_RETRIES):
            try:
                deployment = self.api.get(self.path)
                index, container = self._container(deployment)
                if self._value(container) == value:
                    return ActuatorResult(True, {KNOB_MAX_NUM_SEQS: value})
                containers = copy.deepcopy(deployment["spec"]["template"]["spec"]["containers"])
                in_command = (
                    read_flag([str(a) for a in container.get("command") or []], self.flag) is not None
                )
                field = "command" if in_command else "args"
                containers[index][field] = set_flag(
                    [str(a) for a in container.get(field) or []], self.flag, value
                )
                patch = {
                    "metadata": {"resourceVersion": deployment.get("metadata", {}).get("resourceVersion")},
                    "spec": {"template": {"spec": {"containers": containers}}},
                }
                if patch["metadata"]["resourceVersion"] is None:
                    del patch["metadata"]
                _, patched = self._container(self.api.merge_patch(self.path, patch))
            except KubeError as err:
                if err.status == 409:
                    continue
                return ActuatorResult(False, {}, f"{self.where}: {err}")
            return ActuatorResult(True, {KNOB_MAX_NUM_SEQS: self._value(patched)})
        return ActuatorResult(False, {}, f"{self.where}: still conflicting after {CONFLICT_RETRIES} attempts")
