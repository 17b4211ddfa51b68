"""Actuators change an engine's knobs. `Actuator` is the protocol every one implements (the kvtune admin
API here; a Kubernetes Deployment patch for vLLM elsewhere); a failure is returned as a result, never
raised, so the operator records it as a finding and keeps running."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import httpx

from kvtune.operator.engine_view import KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP

KnobValues = dict[str, int | None]


@dataclass(frozen=True)
class ActuatorResult:
    ok: bool
    values: KnobValues  # the knobs as the engine reports them after the call (empty on failure)
    error: str | None = None


class Actuator(Protocol):
    knobs: frozenset[str]  # which knobs this actuator can change

    def current(self) -> ActuatorResult: ...

    def apply(self, knob: str, value: int | str | None) -> ActuatorResult: ...


class KvtuneAdminActuator:
    """A kvtune engine's live `GET/PATCH /admin/config`, bearer-token guarded."""

    knobs = frozenset({KNOB_MAX_NUM_SEQS, KNOB_MAX_TOKENS_CAP})

    def __init__(self, url: str, token: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/") + "/admin/config"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout = timeout

    def _call(self, method: str, body: dict[str, int | str | None] | None = None) -> ActuatorResult:
        try:
            response = httpx.request(method, self.url, json=body, headers=self.headers, timeout=self.timeout)
        except (httpx.HTTPError, httpx.InvalidURL) as err:
            return ActuatorResult(False, {}, f"admin API unreachable: {type(err).__name__}: {err}")
        if response.status_code != 200:
            return ActuatorResult(
                False, {}, f"admin API {method}: HTTP {response.status_code}: {response.text[:200]}"
            )
        try:
            data = response.json()
            values: KnobValues = {knob: data[knob] for knob in self.knobs}
        except (ValueError, KeyError, TypeError) as err:
            return ActuatorResult(False, {}, f"admin API answered unexpectedly: {err}")
        return ActuatorResult(True, values)

    def current(self) -> ActuatorResult:
        return self._call("GET")

    def apply(self, knob: str, value: int | str | None) -> ActuatorResult:
        if knob not in self.knobs:
            return ActuatorResult(False, {}, f"a kvtune engine cannot change {knob} at run time")
        return self._call("PATCH", {knob: value})
