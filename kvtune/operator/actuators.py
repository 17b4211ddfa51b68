"""Actuators change an engine's knobs. `Actuator` is the protocol every one implements (the admin API of a
kvtune engine or a kvtune proxy here; a Kubernetes Deployment patch for vLLM elsewhere; a composition of
them for a vLLM or SGLang target behind a proxy); a failure is returned as a result, never raised, so the
operator records it as a finding and keeps running."""

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
        self.url = url.rstrip("/") + "/admin/config"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout = timeout
        self.knobs = knobs
        self.name = name

    def _call(self, method: str, body: dict[str, int | str | None] | None = None) -> ActuatorResult:
        try:
            response = httpx.request(method, self.url, json=body, headers=self.headers, timeout=self.timeout)
        except (httpx.HTTPError, httpx.InvalidURL) as err:
            return ActuatorResult(False, {}, f"{self.name} unreachable: {type(err).__name__}: {err}")
        if response.status_code != 200:
            return ActuatorResult(
                False, {}, f"{self.name} {method}: HTTP {response.status_code}: {response.text[:200]}"
            )
        try:
            data = response.json()
            values: KnobValues = {knob: data[knob] for knob in self.knobs}
        except (ValueError, KeyError, TypeError) as err:
            return ActuatorResult(False, {}, f"{self.name} answered unexpectedly: {err}")
        return ActuatorResult(True, values)

    def current(self) -> ActuatorResult:
        return self._call("GET")

    def apply(self, knob: str, value: int | str | None) -> ActuatorResult:
        if knob not in self.knobs:
            return ActuatorResult(False, {}, f"the {self.name} cannot change {knob} at run time")
        return self._call("PATCH", {knob: value})


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
        values: KnobValues = {}
        errors: list[str] = []
        answered = False
        for part in self.parts:
            result = part.current()
            if result.ok:
                answered = True
                values.update({knob: v for knob, v in result.values.items() if self.owner(knob) is part})
            else:
                errors.append(result.error or "unavailable")
        return ActuatorResult(answered, values, "; ".join(errors) or None)

    def apply(self, knob: str, value: int | str | None) -> ActuatorResult:
        part = self.owner(knob)
        if part is None:
            return ActuatorResult(False, {}, f"no actuator here changes {knob}")
        return part.apply(knob, value)
