"""Counters of Fetch serving, per schedule and per namespace; exported by Stats (and metrics).

Every field is a total since the schedule was pushed (or, for a namespace,
since the daemon started), in base units: entries, bytes, seconds.
``snapshot()`` is a consistent copy, cheap enough to take per Stats call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

__all__ = ["PrefetchCounters"]


@dataclass
class PrefetchCounters:
    """Serving counters; ``add`` and ``snapshot`` are thread-safe."""

    #: Entries served with their bytes.
    hits: int = 0
    #: Entries served as misses (absent, or corrupt and deleted).
    misses: int = 0
    #: Entries that failed verification when read (also counted in ``misses``).
    corrupt: int = 0
    #: Entries that were ready when the consumer asked for them.
    ready_on_ask: int = 0
    #: Times the consumer had to wait for the reader, and for how long in total.
    stalls: int = 0
    stall_seconds: float = 0.0
    #: Value bytes read from the store (from disk when cold).
    read_bytes: int = 0
    #: Entry bytes sent to consumers.
    served_bytes: int = 0
    #: Entries the consumer read from the store itself (warm, over shared memory: _direct.py).
    direct: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    @staticmethod
    def hit_ratio(snapshot: dict[str, float]) -> float:
        """hits / (hits + misses) of a snapshot; 0.0 before anything was served."""
        total = snapshot["hits"] + snapshot["misses"]
        return snapshot["hits"] / total if total else 0.0
