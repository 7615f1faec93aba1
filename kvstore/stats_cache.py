"""Store statistics served from memory, refreshed by a thread of their own.

Who calls it: ``AsyncEngine.stats`` (the node's ``/metrics`` and ``/health`` run on the event loop).
``store.stats()`` may block -- a daemon client waits up to its timeout for a stopped daemon, longer
while another thread holds the client's lock -- so the event loop never calls it: a ``kv-stats``
thread refreshes a snapshot every ``interval_s`` and a scrape reads the last one (``age_s`` says how
old; a store that fails keeps its last snapshot and counts ``refresh_failures``).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class StatsCache:
    def __init__(self, store, interval_s: float = 1.0) -> None:
        self.store, self.interval_s = store, interval_s
        self._snapshot: dict = {}
        self._at = 0.0
        self.refresh_failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-stats", daemon=True)
        self._thread.start()

    def get(self) -> dict:
        """The last snapshot ({} before the first refresh); never blocks on the store."""
        return self._snapshot

    @property
    def age_s(self) -> float:
        return time.monotonic() - self._at if self._at else float("inf")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.interval_s)

    def refresh(self) -> None:
        try:
            snapshot = self.store.stats()
        except Exception as exc:  # noqa: BLE001 - a store that is down keeps its last figures
            self.refresh_failures += 1
            log.debug("store stats unavailable: %s", exc)
            return
        self._snapshot, self._at = snapshot, time.monotonic()
