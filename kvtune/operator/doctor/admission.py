"""Which vLLM flag the doctor tells a person to set for max_num_seqs: `--max-num-active-seqs` where the
engine's vLLM has it (0.32 and later), else `--max-num-seqs` (the operator's own choice, `admission_flag`).
The doctor reads vLLM's `GET /version` beside the `/metrics` it scrapes, or takes the version from vLLM's
log or the pod's image; an engine whose metrics show it is kvtune (its live max_num_seqs gauge) or SGLang,
or whose vLLM version is unknown, gets no flag advice."""

from __future__ import annotations

from typing import Any

from kvtune.contract import metrics as m
from kvtune.operator.decide.admission_flag import choose_flag
from kvtune.operator.decide.sample import Sample
from kvtune.operator.io.http import read_vllm_version

ASKED = "the engine's /version"  # where choose_flag says a reported version came from
NOT_VLLM_GAUGES = (m.MAX_NUM_SEQS, m.RETRACTED_NOW, m.CACHE_HIT_RATE_GAUGE)  # kvtune's, SGLang's own


def engine_base(metrics_url: str) -> str:
    """The server's base URL from its /metrics URL (or its base URL)."""
    return metrics_url.rstrip("/").removesuffix("/metrics")


def admission_advice(
    metrics_url: str | None,
    latest: Sample | None,
    known_version: str | None = None,
    version_from: str = "its log",
) -> dict[str, Any] | None:
    """{flag, why, vllm_version} for a vLLM engine read directly, or whose version the doctor read elsewhere
    (`known_version`: vLLM's log, the pod's image); None otherwise (through Prometheus alone there is no
    server to ask its version)."""
    if latest is None or any(name in latest.gauges for name in NOT_VLLM_GAUGES):
        return None
    version = known_version
    if version is None and metrics_url is not None:
        version = read_vllm_version(engine_base(metrics_url))
        version_from = ASKED
    if version is None:
        return None
    choice = choose_flag("Auto", [], version, None)
    return {"flag": choice.flag, "why": choice.why.replace(ASKED, version_from), "vllm_version": version}
