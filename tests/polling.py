"""The one way tests wait: poll a condition until a deadline (never a fixed sleep)."""

from __future__ import annotations

import time

POLL_INTERVAL_S = 0.05


def wait_until(condition, timeout: float, what: str):
    """Return the first truthy ``condition()``; raise TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(POLL_INTERVAL_S)
    raise TimeoutError(f"not within {timeout}s: {what}")
