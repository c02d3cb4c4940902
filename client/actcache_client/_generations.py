"""What this process stored in the daemon: the fingerprints it wrote entries under, and their samples.

A fingerprint is superseded when its prefix was unfrozen and trained further:
``superseded`` hands it back once, so that its entries can be dropped. The
samples stored per depth are told to the planner (a plan weighs what is stored).
"""

from __future__ import annotations

from typing import Callable

from actcache_client._planner import CachePlanner

__all__ = ["Generations"]


class Generations:
    """Fingerprints written -> (depth, data fingerprint), and the sample ids stored (or found) under each."""

    def __init__(self, planner: CachePlanner | None) -> None:
        self._planner = planner
        self._written_at: dict[bytes, tuple[int, bytes]] = {}  # fingerprint written -> (depth, data fingerprint)
        self._samples: dict[bytes, set[int]] = {}  # fingerprint -> sample ids stored (or found) under it

    def deepest(self) -> int:
        """The deepest depth written at (0: none)."""
        return max((depth for depth, _ in self._written_at.values()), default=0)

    def wrote(self, fingerprint: bytes, depth: int, data: bytes) -> None:
        """Entries of ``data`` were written under ``fingerprint`` at ``depth``."""
        self._written_at.setdefault(fingerprint, (depth, data))

    def mark(self, fingerprint: bytes, depth: int, ids: list[int]) -> None:
        """The samples ``ids`` are stored under ``fingerprint`` at ``depth``."""
        samples = self._samples.setdefault(fingerprint, set())
        samples.update(ids)
        if self._planner is not None:
            self._planner.set_written(depth, len(samples))

    def count(self, fingerprint: bytes) -> int:
        """How many samples are known to be stored under ``fingerprint``."""
        return len(self._samples.get(fingerprint, ()))

    def forget(self, fingerprint: bytes) -> None:
        """The daemon dropped ``fingerprint``'s entries."""
        self._samples.pop(fingerprint, None)

    def superseded(self, keyed: Callable[[int, bytes], bytes]) -> list[bytes]:
        """Forget and return the fingerprints written that ``keyed(depth, data)`` no longer gives."""
        gone = [fp for fp, (depth, data) in self._written_at.items() if keyed(depth, data) != fp]
        for fingerprint in gone:
            del self._written_at[fingerprint]
            self._samples.pop(fingerprint, None)
        return gone
