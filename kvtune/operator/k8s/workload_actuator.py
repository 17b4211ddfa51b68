"""Change max_num_seqs of a vLLM or SGLang engine by patching its workload's (a Deployment's or a
StatefulSet's) pod template: one patch, one rolling restart of every replica, because neither engine can
change it at run time. For vLLM the flag is the admission one `admission_flag` chooses
(`--max-num-active-seqs` where the version has it, else `--max-num-seqs`).

The patch is a JSON merge patch carrying the resourceVersion that was read, so the API server refuses it
(409 Conflict) when someone else changed the workload meanwhile; then it is read again and re-applied, a
bounded number of times. It is written as field manager `kvtune`, and sets the workload's
`kubernetes.io/change-cause` annotation to what changed and why (the controller copies it to the new
ReplicaSet, so `kubectl rollout history` is the audit trail). Like every Actuator, failures are returned,
never raised.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import Any

from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS
from kvtune.operator.decide.admission_flag import (
    MAX_NUM_SEQS,
    AdmissionFlagChoice,
    FlagChoice,
    admission_value,
    choose_flag,
    container_device,
)
from kvtune.operator.decide.ports import ActuatorInfo, ActuatorResult
from kvtune.operator.io.http import VERSIONS
from kvtune.operator.k8s.bounded_patch import Freshness
from kvtune.operator.k8s.kube_api import KubeApi, KubeError, WorkloadKind

# the engine flag that bounds concurrently running requests (vLLM's is chosen per workload)
FLAGS = {"vllm": MAX_NUM_SEQS, "sglang": "--max-running-requests"}
CONFLICT_RETRIES = 5
CHANGE_CAUSE = "kubernetes.io/change-cause"
CHANGE_CAUSE_LIMIT = 1024

logger = logging.getLogger("kvtune.operator")


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


def unset_flag(args: list[str], flag: str) -> list[str]:
    """The argument list without the flag (`--flag N` or `--flag=N`, either spelling): what an undo puts back
    when the workload did not set it before the operator did."""
    names = _spellings(flag)
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        name, eq, _ = arg.partition("=")
        if name in names:
            skip = not eq
            continue
        out.append(arg)
    return out


class WorkloadArgsActuator:
    """max_num_seqs through one container's args in a Deployment or StatefulSet."""

    knobs = frozenset({KNOB_MAX_NUM_SEQS})

    def __init__(
        self, api: KubeApi, kind: WorkloadKind, namespace: str, name: str, container: str | None,
        engine: str, admission: AdmissionFlagChoice = "Auto", version_url: str | None = None,
    ) -> None:  # fmt: skip
        if engine not in FLAGS:
            raise ValueError(f"no workload-args actuator for engine {engine!r}")
        self.api = api
        self.kind: WorkloadKind = kind
        self.namespace, self.name = namespace, name
        self.where = f"{kind.lower()} {namespace}/{name}"
        self.container = container
        self.engine = engine
        self.admission: AdmissionFlagChoice = admission
        self.version_url = version_url
        self.flag_choice: FlagChoice | None = None  # the flag of the last read: Events and status name it
        self.patched_generation: int | None = (
            None  # the generation the last patch made (a rollout to wait for)
        )
        self.conflicts = 0  # resourceVersion conflicts met (and retried) by this actuator's patches
        self.observed: dict[str, Any] | None = None  # the workload as this evaluation read it (see observe)
        # the data this evaluation decides on (`bounded_patch.Freshness`): a patch lands within one interval of it
        # or is not made; None: no bound (the actuator used outside an evaluation)
        self.freshness: Freshness | None = None
        self.clock: Callable[[], float] = time.time

    def decides_on(self, freshness: Freshness, clock: Callable[[], float] = time.time) -> None:
        """Bound this evaluation's patches by the freshness of the data it decided on."""
        self.freshness, self.clock = freshness, clock

    def _stale(self) -> str | None:
        return None if self.freshness is None else self.freshness.stale(self.clock())

    def reported_version(self) -> str | None:
        """vLLM's own `GET /version`, from the process's cache of answers (None while it cannot be read)."""
        return VERSIONS.version(self.version_url) if self.version_url is not None else None

    def _container(self, workload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        containers = workload.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []
        for index, container in enumerate(containers):
            if self.container is None or container.get("name") == self.container:
                return index, container
        raise KubeError(404, "ContainerNotFound", f"{self.where} has no container {self.container!r}")

    def _flag(self, container: dict[str, Any]) -> FlagChoice:
        if self.engine != "vllm":
            return FlagChoice(FLAGS[self.engine], f"{self.engine}'s admission flag")
        words = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
        choice = choose_flag(self.admission, words, self.reported_version(), container.get("image"))
        self.flag_choice = choice
        return choice

    @staticmethod
    def _read(container: dict[str, Any], flag: str) -> int | None:
        found = read_flag([str(a) for a in container.get("args") or []], flag)
        return (
            found if found is not None else read_flag([str(a) for a in container.get("command") or []], flag)
        )

    def _value(self, container: dict[str, Any], flag: str) -> int | None:
        """The admission limit in force: the chosen flag, else --max-num-seqs (vLLM's default for it)."""
        found = self._read(container, flag)
        return found if found is not None or flag == MAX_NUM_SEQS else self._read(container, MAX_NUM_SEQS)

    def read(self, fresh: bool = False) -> dict[str, Any]:
        return self.api.read_workload(self.kind, self.namespace, self.name, fresh)

    def observe(self, workload: dict[str, Any]) -> None:
        """Take `workload` (read this evaluation, for its rollout and reverts) as what `current()` reports, so
        the evaluation decides on the one state it checked: a revert landing after that read is seen, and
        counted, at the next evaluation rather than silently re-applied in this one."""
        self.observed = workload

    def current(self) -> ActuatorResult:
        try:
            _, container = self._container(self.observed if self.observed is not None else self.read())
        except KubeError as err:
            return ActuatorResult(False, {}, f"{self.where}: {err}")
        return ActuatorResult(True, {KNOB_MAX_NUM_SEQS: self._value(container, self._flag(container).flag)})

    def device(self) -> str | None:
        """Where the engine runs, as its container in the workload last observed says (`container_device`):
        the operator rounds its recommendation for that device, as the doctor does."""
        if self.observed is None:
            return None
        try:
            _, container = self._container(self.observed)
        except KubeError:
            return None
        return container_device(container)[0]

    def container_name(self, workload: dict[str, Any]) -> str | None:
        """The name of the container the flag lives in (managedFields key containers by name)."""
        try:
            return self._container(workload)[1].get("name")
        except KubeError:
            return None

    def held(self, workload: dict[str, Any]) -> int | None:
        """The admission limit the workload's container sets now."""
        try:
            _, container = self._container(workload)
        except KubeError:
            return None
        return self._value(container, self._flag(container).flag)

    def holds(self, workload: dict[str, Any], value: int) -> bool:
        """Whether the workload already sets the admission flag as `apply(value)` would."""
        try:
            _, container = self._container(workload)
        except KubeError:
            return False
        flag = self._flag(container).flag
        return self._read(container, flag) == admission_value(
            flag, value, self._read(container, MAX_NUM_SEQS)
        )

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        if knob != KNOB_MAX_NUM_SEQS:
            return ActuatorResult(
                False, {}, f"a {self.kind} patch here changes only max_num_seqs, not {knob}"
            )
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return ActuatorResult(False, {}, f"max_num_seqs must be a positive integer, got {value!r}")
        self.patched_generation = None
        for attempt in range(1, CONFLICT_RETRIES + 1):
            stale = self._stale()
            if stale is not None:
                return ActuatorResult(False, {}, f"{self.where}: {stale}")
            try:
                workload = self.read(fresh=True)  # the write's resourceVersion: never the watch's copy
                index, container = self._container(workload)
                flag = self._flag(container).flag
                wanted = (
                    None
                    if value is None
                    else admission_value(flag, value, self._read(container, MAX_NUM_SEQS))
                )
                before = self._read(container, flag)
                if before == wanted:
                    return ActuatorResult(True, {KNOB_MAX_NUM_SEQS: self._value(container, flag)})
                containers = copy.deepcopy(workload["spec"]["template"]["spec"]["containers"])
                in_command = read_flag([str(a) for a in container.get("command") or []], flag) is not None
                field = "command" if in_command else "args"
                words = [str(a) for a in container.get(field) or []]
                # None (an undo of a flag the workload never set) takes the flag out again
                containers[index][field] = (
                    unset_flag(words, flag) if wanted is None else set_flag(words, flag, wanted)
                )
                why = (
                    f"kvtune: {flag} {before if before is not None else 'unset'} -> "
                    f"{wanted if wanted is not None else 'unset'}"
                )
                metadata: dict[str, Any] = {
                    "annotations": {CHANGE_CAUSE: f"{why}; {cause}"[:CHANGE_CAUSE_LIMIT] if cause else why}
                }
                version = workload.get("metadata", {}).get("resourceVersion")
                if version is not None:
                    metadata["resourceVersion"] = version
                patch = {"metadata": metadata, "spec": {"template": {"spec": {"containers": containers}}}}
                stale = self._stale()
                if stale is not None:  # the reads took too long (the API server slow or away)
                    return ActuatorResult(False, {}, f"{self.where}: {stale}")
                deadline = self.freshness.deadline if self.freshness is not None else None
                patched = self.api.patch_workload(self.kind, self.namespace, self.name, patch, deadline)
                _, after = self._container(patched)
            except KubeError as err:
                if err.status == 409:
                    self.conflicts += 1
                    logger.warning("%s changed while it was patched (attempt %d of %d): read again and "
                                   "retried", self.where, attempt, CONFLICT_RETRIES)  # fmt: skip
                    continue
                stale = self._stale()
                if stale is not None:  # e.g. the API server gave up on it at the deadline (etcd away)
                    return ActuatorResult(False, {}, f"{self.where}: {err}; {stale}")
                return ActuatorResult(False, {}, f"{self.where}: {err}")
            generation = patched.get("metadata", {}).get("generation")
            self.patched_generation = generation if isinstance(generation, int) else None
            if self.observed is not None:
                self.observed = patched
            return ActuatorResult(True, {KNOB_MAX_NUM_SEQS: self._value(after, flag)})
        return ActuatorResult(False, {}, f"{self.where}: still conflicting after {CONFLICT_RETRIES} attempts")

    def describe(self) -> ActuatorInfo:
        """The flag of the last read, and why that one (None before the first read)."""
        choice = self.flag_choice
        return ActuatorInfo(admission_flag=f"{choice.flag} ({choice.why})" if choice is not None else None)
