"""Generations: the activity of each (namespace, fingerprint), and which dead ones a put may reclaim.

A generation is every entry of one (namespace, fingerprint), at every depth. Refreezing a trained
prefix starts a new one; the old one can never be served again, yet keeps its bytes until dropped.
Per generation the daemon knows its last write (persisted in the ``generations`` table with the
put; None: written before this was recorded), its last read (Get, Contains, Schedule, Fetch; in
memory only, so after a restart the daemon's start time stands in for it) and its pins (live
schedules reading it).

A generation is *dead* when nothing pins it and, with ``reclaim_after_s`` > 0, neither a read nor
a write touched it for ``reclaim_after_s`` seconds. ``plan_reclaim`` picks which dead generations
a put over budget drops.

Concurrency: the tracker's lock is a leaf (nothing else is locked while it is held).
"""

from __future__ import annotations

import builtins
import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence, overload

from actcache.daemon.config import format_size
from actcache.keys import fingerprint_of, namespace_id_of, namespace_of

__all__ = ["Generation", "Generations", "ReclaimPlan", "plan_reclaim", "read_write_time", "write_time"]

log = logging.getLogger(__name__)

_TIME = struct.Struct(">d")


def write_time(when: float) -> bytes:
    """The ``generations`` table's value for a last write at ``when``."""
    return _TIME.pack(when)


@overload
def read_write_time(value: bytes | memoryview) -> float: ...
@overload
def read_write_time(value: None) -> None: ...
def read_write_time(value: bytes | memoryview | None) -> float | None:
    """The last write a ``generations`` table value holds (None for no value)."""
    return None if value is None else _TIME.unpack(bytes(value))[0]


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation as Stats and a reclaim decision see it."""

    prefix: bytes
    bytes: int
    #: Wall clock seconds; None = unknown (written before last writes were recorded).
    last_write: float | None
    #: Wall clock seconds; None = not read since the daemon started.
    last_read: float | None
    #: Live schedules reading it.
    pins: int
    dead: bool

    @property
    def namespace_id(self) -> int:
        return namespace_id_of(self.prefix)

    @property
    def fingerprint(self) -> builtins.bytes:  # builtins: the field ``bytes`` shadows the type in this class
        return fingerprint_of(self.prefix)


@dataclass(frozen=True, slots=True)
class ReclaimPlan:
    """What ``plan_reclaim`` found: the generations to drop (empty when they would not make the put fit)."""

    victims: list[Generation]
    #: Bytes of the dead generations that could count for the put (its namespace's, or all for the daemon budget).
    reclaimable_bytes: int
    fits: bool


def plan_reclaim(dead: Sequence[Generation], *, own: bytes, namespace: bytes, namespace_need: int,
                 daemon_need: int) -> ReclaimPlan:
    """Choose whole dead generations to drop so that a put fits its budgets.

    ``dead``: the dead generations of every namespace; ``own``: the put's generation (never chosen);
    ``namespace``: the put's namespace id (4 bytes); ``*_need``: bytes to free for each budget (<= 0:
    it fits). The namespace's own go first, oldest last write first (unknown counts as oldest), until
    its need is met; any namespace's then make up the rest of the daemon budget's need.
    """
    order = sorted((g for g in dead if g.prefix != own and g.bytes > 0),
                   key=lambda g: (g.last_write is not None, g.last_write or 0.0, g.prefix))
    mine = [g for g in order if namespace_of(g.prefix) == namespace]
    reclaimable = sum(g.bytes for g in (order if daemon_need > 0 else mine))
    victims: dict[bytes, Generation] = {}
    freed = 0
    for need, candidates in ((namespace_need, mine), (daemon_need, order)):
        for g in candidates:
            if freed >= need:
                break
            if g.prefix not in victims:
                victims[g.prefix] = g
                freed += g.bytes
        if freed < need:
            return ReclaimPlan([], reclaimable, False)
    return ReclaimPlan(list(victims.values()), reclaimable, True)


class Generations:
    """Last write, last read and pins of every generation, and the reclaim counters (thread-safe)."""

    def __init__(self, reclaim_after_s: float, *, clock: Callable[[], float] = time.time) -> None:
        self.reclaim_after_s = reclaim_after_s
        self._clock = clock
        self.started = clock()
        self._lock = threading.Lock()
        self._written: dict[bytes, float] = {}
        self._read: dict[bytes, float] = {}
        self._pins: dict[bytes, int] = {}
        self.reclaimed_generations = 0
        self.reclaimed_bytes = 0

    def now(self) -> float:
        return self._clock()

    def load(self, rows: Iterable[tuple[bytes, float]]) -> None:
        """The persisted last writes, at start."""
        with self._lock:
            self._written.update(rows)

    def wrote(self, prefix: bytes, when: float) -> None:
        """A put to the generation committed (called after the commit that persisted ``when``)."""
        with self._lock:
            if when > self._written.get(prefix, float("-inf")):
                self._written[prefix] = when

    def read(self, prefix: bytes, pins: int = 0) -> None:
        """Entries of the generation were read or asked for (hot path: one dict store); ``pins``: live
        schedules added (a push) or removed (one served to its end, replaced or released)."""
        when = self._clock()
        with self._lock:
            self._read[prefix] = when
            if pins:
                self._pins[prefix] = self._pins.get(prefix, 0) + pins
                if self._pins[prefix] <= 0:
                    del self._pins[prefix]

    def pin(self, prefix: bytes) -> None:
        self.read(prefix, 1)

    def unpin(self, prefix: bytes) -> None:
        self.read(prefix, -1)

    def forget(self, prefix: bytes) -> None:
        """The generation's entries are all gone (a drop): its times go too; pins stay with their schedules."""
        with self._lock:
            self._written.pop(prefix, None)
            self._read.pop(prefix, None)

    def reclaimed(self, namespace: str, gen: Generation, entries: int, nbytes: int, *, complete: bool) -> None:
        """Count and log a reclaim of ``gen`` (of the namespace called ``namespace``) that deleted ``entries``;
        ``complete`` False: it stopped early, the generation having been used since it was chosen."""
        if not complete:
            log.info("reclaim of generation %s/%s stopped after %d entries (%d bytes): it was written, read or "
                     "scheduled since it was chosen", namespace, gen.fingerprint.hex(), entries, nbytes)
        if not entries:
            return
        now = self._clock()
        with self._lock:
            self.reclaimed_generations += 1
            self.reclaimed_bytes += nbytes
        log.info("reclaimed dead generation %s/%s: %d entries, %d bytes (%s); last write %s, last read %s",
                 namespace, gen.fingerprint.hex(), entries, nbytes, format_size(nbytes),
                 _age(gen.last_write, now, "unknown"),
                 _age(gen.last_read, now, f"none since the daemon started {now - self.started:.0f} s ago"))

    def describe(self, plan: ReclaimPlan) -> str:
        """What a refusal says about ``plan``: how many bytes were reclaimable, under which rule."""
        after = f", unused for {self.reclaim_after_s:g} s (--reclaim-after)" if self.reclaim_after_s else ""
        return (f"dead generations (no live schedule{after}) hold {plan.reclaimable_bytes} bytes "
                f"({format_size(plan.reclaimable_bytes)}) that could be reclaimed{'' if plan.fits else ', not enough'}")

    def last_write(self, prefix: bytes) -> float | None:
        with self._lock:
            return self._written.get(prefix)

    def known(self) -> list[bytes]:
        """Generations with a recorded last write."""
        with self._lock:
            return list(self._written)

    def is_dead(self, prefix: bytes) -> bool:
        with self._lock:
            return self._dead(prefix, self._clock())

    def _dead(self, prefix: bytes, now: float) -> bool:
        if self._pins.get(prefix):
            return False
        if not self.reclaim_after_s:
            return True
        active = max(self._written.get(prefix, float("-inf")), self._read.get(prefix, self.started))
        return now - active >= self.reclaim_after_s

    def snapshot(self, usage: Mapping[bytes, int]) -> list[Generation]:
        """Every generation in ``usage`` (prefix -> stored bytes) with its activity, now."""
        now = self._clock()
        with self._lock:
            return [Generation(prefix, nbytes, self._written.get(prefix), self._read.get(prefix),
                               self._pins.get(prefix, 0), self._dead(prefix, now))
                    for prefix, nbytes in sorted(usage.items())]


def _age(when: float | None, now: float, unknown: str) -> str:
    return unknown if when is None else f"{now - when:.0f} s ago"
