"""Up/down state of one lower tier, with exponential back-off between probes.

Who calls it: ``TieredStore`` before and after every call into Redis or disk.
    up --error--> down (retry after base_s) --probe fails--> down (2x, capped at max_s)
                                             --probe works--> up
While down, ``available()`` is False until the back-off expires; then one call is let
through as the probe. Transitions are logged once each (WARNING down, INFO up).
Only the probe brings a tier back up: a call admitted before the tier went down that happens
to succeed afterwards says nothing about the tier now (several threads share one TierHealth).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class TierHealth:
    def __init__(self, name: str, base_s: float = 0.5, max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.base_s, self.max_s, self._clock = name, base_s, max_s, clock
        self._lock = threading.Lock()
        self.down = False
        self.failures = 0           # consecutive
        self.transitions_down = 0
        self._retry_at = 0.0
        self._probing = False
        self._prober: int | None = None         # thread id of the call let through as the probe

    def available(self) -> bool:
        """True when up, or when down and this caller may probe (one at a time)."""
        with self._lock:
            if not self.down:
                return True
            if self._probing or self._clock() < self._retry_at:
                return False
            self._probing, self._prober = True, threading.get_ident()
            return True

    def waiting(self) -> bool:
        """Down, and no call may go through now (back-off running, or a probe in flight): what ``available`` would
        refuse, asked without claiming the probe (a caller that then makes no call would hold it)."""
        with self._lock:
            return self.down and (self._probing or self._clock() < self._retry_at)

    def ok(self) -> None:
        with self._lock:
            if self.down and self._prober != threading.get_ident():
                return                  # a call from before the failure: only the probe decides
            if self.down:
                log.info("KV tier %s is back up after %d failed attempts", self.name, self.failures)
            self.down, self.failures, self._probing, self._prober = False, 0, False, None

    def release(self) -> None:
        """The call said nothing about the tier (a bad request, not an outage): let the next one probe."""
        with self._lock:
            if self._prober == threading.get_ident():
                self._probing, self._prober = False, None

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            delay = min(self.max_s, self.base_s * 2 ** (self.failures - 1))
            if not self.down:
                self.transitions_down += 1
                log.warning("KV tier %s marked down (%s: %s); retrying in %.2fs; serving from the other tiers",
                            self.name, type(exc).__name__, exc, delay)
            self.down, self._probing, self._retry_at = True, False, self._clock() + delay
            self._prober = None

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"down": int(self.down), "consecutive_failures": self.failures,
                    "marked_down": self.transitions_down}
