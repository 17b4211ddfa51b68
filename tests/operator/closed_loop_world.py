"""Reading the closed-loop recordings."""

from __future__ import annotations

from kvtune.operator.decide.sample import Sample
from kvtune.operator.io.sources import MetricsEndpoint


def read(source: MetricsEndpoint) -> Sample:
    sample = source.read()
    assert isinstance(sample, Sample), sample
    return sample
