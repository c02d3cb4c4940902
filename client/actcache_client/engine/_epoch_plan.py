"""The epoch as the loader planned it: this rank's batches, the stream of their entries, the skipped loads.

The plan pushes the epoch's batches (``begin``) to the daemon's stream at the cache target, follows the
step through them (``advance``), pushes the rest again when the target changes, and tells the loader which
samples are stored (``skips``: their inputs need not be loaded, except those the audit recomputes). While
an epoch has no misses, the next one is pushed ahead.
"""

from __future__ import annotations

from itertools import compress, islice
from typing import Sequence

from actcache.errors import LifecycleError
from actcache_client.engine._audit import HitAudit
from actcache_client.transport._connection import Connection, connected
from actcache_client.transport._epoch_stream import EpochStream, Target, cached_batches

__all__ = ["EpochPlan", "Target"]


class EpochPlan:
    """This epoch's batches (sample ids) and variant, the step's position in them, and the stream.
    Invariant: ``position`` is that of the next batch the step runs; one run out of order gets none."""

    def __init__(self, connection: Connection | None, stream: EpochStream | None, audit: HitAudit) -> None:
        self._connection = connection
        self.stream = stream
        self._audit = audit
        self._epoch: tuple[list[list[int]], int] | None = None  # this epoch's batches (sample ids) and variant
        self.position = 0  # the epoch position of the next batch the step runs
        self.misses = 0  # samples of the cached subset that missed this epoch
        self._skip_loads = False  # the loader can skip loading inputs (its dataset has targets)
        self.skips: dict[int, frozenset[int]] = {}  # epoch position -> sample ids the loader need not load

    def _connected(self) -> Connection:
        if self._connection is None:
            raise LifecycleError("an epoch stream needs a connection to a daemon")
        return self._connection

    def reset(self, skip_loads: bool) -> None:
        """Forget the last epoch: until ``begin``, retargets push nothing."""
        self._epoch, self.skips, self._skip_loads = None, {}, skip_loads

    def begin(self, batches: Sequence[Sequence[int]], variant: int, start: int, target: Target | None) -> None:
        """Start the epoch at batch ``start``: push its batches to the stream (or adopt those pushed ahead)."""
        lists = [list(b) for b in batches]
        self._epoch, self.position, self.misses = (lists, variant), start, 0
        if self.stream is None or target is None:
            return
        if not (start == 0 and self.stream.adopt_next(target, variant, batches)):
            # Entries the last epoch stored must be in the daemon before it looks them up for this one.
            connection = connected(self._connection)
            connection.flush(timeout_s=connection.config.timeout_s)
            self.stream.push(target, variant, batches[start:], start)
        self._plan_skips(target)

    def retarget(self, target: Target | None) -> None:
        """The cache target changed: mid-epoch, the rest of the epoch is pushed again from the current batch."""
        if self.stream is None or self._epoch is None:
            return
        batches, variant = self._epoch
        if target is None:
            self.stream.close()
        elif not self.stream.serves(target, variant):
            self.stream.push(target, variant, batches[self.position:], self.position)
        else:
            return
        self._plan_skips(target)

    def advance(self, ids: list[int]) -> int | None:
        """The epoch position of the batch ``ids`` if it is the one due next (then the step moves on), else None."""
        if self._epoch is None or self.position >= len(self._epoch[0]) or self._epoch[0][self.position] != ids:
            return None
        self.position += 1
        return self.position - 1

    def missed(self, samples: int) -> None:
        """``samples`` of the cached subset missed: the next epoch pushed ahead is pushed again at its start."""
        self.misses += samples
        if samples and self.stream is not None:
            self.stream.discard_next()  # pushed before these misses were stored

    def samples(self) -> int | None:
        """Samples in this epoch's batches (None before the loader's first epoch)."""
        return sum(map(len, self._epoch[0])) if self._epoch is not None else None

    def prepare_next(self, batches: Sequence[Sequence[int]], variant: int, target: Target | None) -> None:
        """Push the next epoch's batches ahead (the CachedForward's loader side says when)."""
        if self.stream is None or target is None or self.misses:
            return
        self.stream.push_next(target, variant, [list(b) for b in batches])

    def _plan_skips(self, target: Target | None) -> None:
        """Ask the daemon which samples of the rest of the epoch are stored at the cache target: the
        loader skips their inputs, except for those the auditor picks (they are recomputed)."""
        self.skips = {}
        if not self._skip_loads or self._epoch is None or target is None or self.stream is None:
            return
        batches, variant = self._epoch
        subset = cached_batches(batches[self.position:], target.fraction)
        ids = [s for b in subset for s in b]
        # the push answered which entries are stored; else ask
        present = self.stream.stored_from(self.position) if self.stream.serves(target, variant) else None
        if present is None or len(present) != len(ids):
            present = self._connected().contains(target.fingerprint, target.depth, ids, variant)
        if present is None or not any(present):  # nothing stored (a write epoch): every input is loaded
            return
        flags = iter(present)
        self._audit.sync()
        for position, batch_ids in enumerate(subset, start=self.position):
            stored = list(compress(batch_ids, islice(flags, len(batch_ids))))
            audited = {stored[p] for p in self._audit.choose(len(stored))}
            self.skips[position] = frozenset(s for s in stored if s not in audited)
