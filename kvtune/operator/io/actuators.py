"""Actuators over HTTP: a kvtune engine's or proxy's admin API, every pod's as one, and a composition of
actuators (a vLLM or SGLang target behind a proxy). They implement `decide.ports.Actuator` (a Deployment's
args are `k8s.workload_actuator`'s); a failure is returned as a result, never raised, so the operator
records it as a finding and keeps running."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvtune.contract.admin import ADMIN_CONFIG_PATH
from kvtune.contract.knobs import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP
from kvtune.operator.decide.ports import Actuator, ActuatorInfo, ActuatorResult, KnobReadings, combined
from kvtune.operator.io.http import shared_client

ENGINE_KNOBS = frozenset({KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP})
PROXY_KNOBS = frozenset({KNOB_MAX_TOKENS_CAP})  # a kvtune proxy caps max_tokens; max_num_seqs is the engine's


class KvtuneAdminActuator:
    """A kvtune engine's or kvtune proxy's live `GET/PATCH /admin/config`, bearer-token guarded. Both answer
    the knobs they hold; `knobs` says which of them this actuator reads and changes (a proxy in front of
    vLLM holds only the max_tokens cap)."""

    def __init__(
        self,
        url: str,
        token: str,
        timeout: float = 10.0,
        knobs: frozenset[str] = ENGINE_KNOBS,
        name: str = "admin API",
    ) -> None:
        self.url = url.rstrip("/") + ADMIN_CONFIG_PATH
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout = timeout
        self.knobs = knobs
        self.name = name

    def _call(self, method: str, body: dict[str, int | str | None] | None = None) -> ActuatorResult:
        try:
            response = shared_client().request(
                method, self.url, json=body, headers=self.headers, timeout=self.timeout
            )
        except (httpx.HTTPError, httpx.InvalidURL) as err:
            return ActuatorResult(False, {}, f"{self.name} unreachable: {type(err).__name__}: {err}")
        if response.status_code != 200:
            return ActuatorResult(
                False, {}, f"{self.name} {method}: HTTP {response.status_code}: {response.text[:200]}"
            )
        try:
            data = response.json()
            values: KnobReadings = {knob: data[knob] for knob in self.knobs}
        except (ValueError, KeyError, TypeError) as err:
            return ActuatorResult(False, {}, f"{self.name} answered unexpectedly: {err}")
        return ActuatorResult(True, values)

    def current(self) -> ActuatorResult:
        return self._call("GET")

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        if knob not in self.knobs:
            return ActuatorResult(False, {}, f"the {self.name} cannot change {knob} at run time")
        return self._call("PATCH", {knob: value})

    def describe(self) -> ActuatorInfo:
        return ActuatorInfo()


class ComposedActuator:
    """Several actuators as one, each knob going to the first part that holds it: a vLLM target behind a
    kvtune proxy gets its cap through the proxy's admin API (live) and max_num_seqs through its Deployment
    (a restart). Reading succeeds when any part answers (a part that cannot is named in `error`), so a proxy
    that is down does not stop the engine's own knobs."""

    def __init__(self, parts: list[Actuator]) -> None:
        self.parts = parts
        self.knobs = frozenset().union(*(part.knobs for part in parts))

    def owner(self, knob: str) -> Actuator | None:
        return next((part for part in self.parts if knob in part.knobs), None)

    def current(self) -> ActuatorResult:
        values: KnobReadings = {}
        split: set[str] = set()
        errors: list[str] = []
        answered = False
        for part in self.parts:
            result = part.current()
            if result.ok:
                answered = True
                values.update({knob: v for knob, v in result.values.items() if self.owner(knob) is part})
                split |= {knob for knob in result.split if self.owner(knob) is part}  # pods that disagree
            else:
                errors.append(result.error or "unavailable")
        return ActuatorResult(answered, values, "; ".join(errors) or None, frozenset(split))

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        part = self.owner(knob)
        if part is None:
            return ActuatorResult(False, {}, f"no actuator here changes {knob}")
        return part.apply(knob, value, cause)

    def describe(self) -> ActuatorInfo:
        return combined([part.describe() for part in self.parts])


MAX_PARALLEL_CALLS = 16


class FanOutActuator:
    """One actuator per pod of a workload as one: `apply` goes to every pod and is ok only when every pod
    is (the error names the pods that failed); `current` reports a knob's value only when every pod that
    answered agrees. A knob they disagree on (a new or replaced pod still at its flags) is None and listed
    in `split`, so the desired-state re-apply (`loop.reapply_desired`) puts it back on every pod."""

    def __init__(self, parts: Mapping[str, Actuator], knobs: frozenset[str]) -> None:
        self.parts = dict(parts)
        self.knobs = knobs
        self.held: dict[str, KnobReadings] = {}  # what each pod last said it holds

    def _each(self, call: Callable[[Actuator], ActuatorResult]) -> dict[str, ActuatorResult]:
        if not self.parts:
            return {}
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_CALLS, len(self.parts))) as pool:
            return dict(zip(self.parts, pool.map(call, self.parts.values()), strict=True))

    def _combined(self, results: dict[str, ActuatorResult], everyone: bool) -> ActuatorResult:
        if not results:
            return ActuatorResult(False, {}, "no ready pod to act on")
        answered = {pod: result for pod, result in results.items() if result.ok}
        self.held.update({pod: dict(result.values) for pod, result in answered.items()})
        failed = sorted(pod for pod in results if pod not in answered)
        error = "; ".join(f"pod {pod}: {results[pod].error}" for pod in failed) or None
        values: KnobReadings = {}
        split: set[str] = set()
        for knob in self.knobs:
            held = {result.values.get(knob) for result in answered.values() if knob in result.values}
            if len(held) == 1:
                values[knob] = held.pop()
            elif held:
                values[knob] = None
                split.add(knob)
        ok = not failed if everyone else bool(answered)
        return ActuatorResult(ok, values if ok else {}, error, frozenset(split) if ok else frozenset())

    def current(self) -> ActuatorResult:
        """What the pods hold; ok when any answered (a pod that did not is named in `error`)."""
        return self._combined(self._each(lambda part: part.current()), everyone=False)

    def apply(self, knob: str, value: int | str | None, cause: str = "") -> ActuatorResult:
        return self._combined(self._each(lambda part: part.apply(knob, value, cause)), everyone=True)

    def describe(self) -> ActuatorInfo:
        return ActuatorInfo(held_by_pod={pod: dict(values) for pod, values in self.held.items()})
