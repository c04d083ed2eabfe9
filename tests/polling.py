"""Waiting in tests for something another process does: poll a predicate until it holds, bounded."""
from __future__ import annotations

import time


def wait_for(pred, timeout: float, what: str, interval: float = 0.1):
    """pred()'s first truthy value within `timeout` seconds; else an AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
