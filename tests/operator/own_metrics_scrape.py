"""The operator's own metrics, scraped as an exposition."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvtune.operator.io.own_metrics import OperatorMetrics
from tests.operator.helpers import Series, parse_series


def scraped(metrics: OperatorMetrics) -> Series:
    return parse_series(generate_latest(metrics.registry).decode())
