"""Ticks of a policy against the emulator with the mode ceiling and undo in play."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvtune.operator.k8s.crd import KVTuningPolicySpec
from kvtune.operator.k8s.events import PolicyRef
from kvtune.operator.k8s.kube_api import KubeApi
from kvtune.operator.k8s.reconcile import Outcome, PolicyMemory, PolicyTick, run_once
from tests.operator.kmock_world import (
    NS,
)

REF = PolicyRef(NS, "llama", "uid-llama")


async def ticks(spec: dict[str, Any], memory: PolicyMemory, count: int, **kwargs: Any) -> list[Outcome]:
    """`count` evaluations a few tenths of a second apart (the recorded metrics move after the first)."""
    parsed = KVTuningPolicySpec.model_validate(spec)

    def run() -> list[Outcome]:
        done = []
        with KubeApi.from_environment() as api:
            for _ in range(count):
                done.append(run_once(api, PolicyTick(REF, parsed, time.time(), **kwargs), memory))
                time.sleep(0.3)
        return done

    return await asyncio.to_thread(run)
