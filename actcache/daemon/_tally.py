"""Counters shared between threads: a dataclass of numbers with ``add`` and a consistent ``snapshot``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields, replace
from typing import Self

__all__ = ["Tally"]


@dataclass
class Tally:
    """Base of the daemon's counter dataclasses; subclasses declare the counters as fields."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}

    def copy(self) -> Self:
        """A consistent copy, with a lock of its own."""
        with self._lock:
            return replace(self)
