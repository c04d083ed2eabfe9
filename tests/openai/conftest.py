"""Fixtures: the shim served by a real uvicorn on a free localhost port, in a background thread."""
from __future__ import annotations

import pytest

from openai_shim_helpers import RunningShim


@pytest.fixture
def start_shim():
    started: list[RunningShim] = []

    def start(app) -> RunningShim:
        shim = RunningShim(app)
        started.append(shim)
        return shim

    yield start
    for shim in started:
        shim.stop()
