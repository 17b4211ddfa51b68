"""The recorded vLLM exposition and log the doctor tests read (docs/examples)."""

from __future__ import annotations

from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


RECORDED = EXAMPLES / "vllm-0.32-cpu-preempting.prom"


RECORDED_LOG = EXAMPLES / "vllm-0.32-cpu-preempting.log"
