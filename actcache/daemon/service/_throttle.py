"""A read throttle for experiments (``--throttle-read-mbps``): reproduces a slow disk on any machine,
so that the client's cost model can be exercised."""

from __future__ import annotations

import threading
import time

from actcache.errors import ConfigError

__all__ = ["Throttle"]


class Throttle:
    """Token bucket of ``rate`` bytes/s with a burst of ``burst_s`` seconds of traffic.

    After an idle spell a reservation of ``n`` bytes waits ``n / rate - burst_s``;
    back to back, reservations are paced at exactly ``rate``.
    """

    def __init__(self, bytes_per_s: float, *, burst_s: float = 0.05) -> None:
        if bytes_per_s <= 0:
            raise ConfigError(f"throttle rate must be > 0 bytes/s, got {bytes_per_s}; pass --throttle-read-mbps > 0")
        self.rate = float(bytes_per_s)
        self._burst = self.rate * burst_s
        self._lock = threading.Lock()
        self._ready_at = time.monotonic()  # when the bucket has paid for all reservations so far

    def consume(self, nbytes: int) -> float:
        """Block until ``nbytes`` may be sent; returns the seconds waited."""
        with self._lock:
            now = time.monotonic()
            # The bucket refills while idle but never holds more than the burst: the slack is
            # granted once, below, not also by backdating the start.
            self._ready_at = max(self._ready_at, now) + nbytes / self.rate
            wait = self._ready_at - now - self._burst / self.rate
        if wait > 0:
            time.sleep(wait)  # rate limiting: the wait is the point
            return wait
        return 0.0
