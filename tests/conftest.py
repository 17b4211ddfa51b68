"""Session-wide test options: the full kernel grids run only when asked for, and no example has a deadline.

Slow cases are deselected rather than skipped, so a normal run reports them as not selected instead of
counting a thousand skips; a skip is kept for what it means here, a real part the machine lacks.

Hypothesis' default 200 ms deadline per example is a verdict on the machine's speed (an example that takes
longer on a slow or busy machine fails as if it were wrong), so it is off for every property test.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("kvtune", deadline=None)
settings.load_profile("kvtune")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run the full kernel grids")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow") or os.environ.get("KVTUNE_RUNSLOW") == "1":
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]
