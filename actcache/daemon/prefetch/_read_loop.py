"""The reader thread of one schedule: walks the order, takes budget, reads entries as stored, publishes them."""

from __future__ import annotations

import time
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Callable, Generic, TypeVar

from actcache.daemon.prefetch import _readahead
from actcache.daemon.prefetch._budget import MemoryBudget
from actcache.daemon.prefetch._lookahead import Prober, ShortTransaction
from actcache.daemon.prefetch._readahead import Handover, ReadAhead, Slot, Stop
from actcache.daemon.store import ExtentHints
from actcache.errors import BudgetExceeded
from actcache.keys import group_prefix
from actcache.served import served_size

if TYPE_CHECKING:
    from actcache.daemon.store import ReadSession, Store

__all__ = ["ReadLoop"]

_Shared = TypeVar("_Shared", bound=ReadAhead)  # the reader whose entries the loop reads, as on_starved gets it

# Entries read and published together while the budget has their bytes (one lock and wake-up check a run).
RUN = 32
# A warm order reads nothing ahead for this long after its reader starts, for its Fetch to come and read it
# itself from its start (DirectRun, in whole frames); past it, a run is read ahead for a later consumer.
_ATTACH_GRACE_S = 0.05
_KEY_BLOCK = 512
# Read bytes are added to the counters every this many entries (one lock each time).
_COUNT_EVERY = 64


class ReadLoop(Generic[_Shared]):
    """Reads a schedule's entries ahead of its consumer, on the reader's own thread.

    Each position is looked up and read as stored (no decoding here), its
    bytes reserved in the shared budget first, then published in order into
    the ``ReadAhead``. Invariants: this thread is the only one that moves
    ``read`` forward while not parked; it holds at most one reservation
    (``_carry``) besides its slots' bytes, and closes its read transaction
    before any wait, so a waiting reader pins no pages.
    """

    def __init__(self, shared: _Shared, handover: Handover, *, store: Store, budget: MemoryBudget,
                 probe_pool: Executor | None, probe_bytes: int, on_starved: Callable[[_Shared, int], None]) -> None:
        """The budget counts this reader's bytes under ``shared`` (its ScheduleReader)."""
        self._schedule, self._guess, self._shared, self._handover = handover.schedule, handover.guess, shared, handover
        self._store, self._budget, self._probe, self._probe_bytes = store, budget, probe_pool, probe_bytes
        self._on_starved = on_starved
        self._keys: dict[int, list[bytes]] = {}
        self._txn = ShortTransaction(store, handover.guess)
        self._prober: Prober | None = None
        self._grace_until = time.monotonic() + _ATTACH_GRACE_S
        self._carry = 0  # budget bytes already held for the entry at ``read`` (taken while the txn was closed)
        self._entries = self._bytes = self._unflushed = self._flushed_at = 0  # entries read, their bytes

    def key(self, pos: int) -> bytes:
        """The store key of position ``pos`` (computed a block at a time)."""
        block = pos // _KEY_BLOCK
        keys = self._keys.get(block)
        if keys is None:  # probes ask ahead of the reader: keep blocks from the reader's on
            for old in [b for b in self._keys if b < self._shared.read // _KEY_BLOCK]:
                del self._keys[old]
            start = block * _KEY_BLOCK
            keys = self._keys[block] = self._schedule.keys(start, min(len(self._schedule), start + _KEY_BLOCK))
        return keys[pos - block * _KEY_BLOCK]

    def read_all(self) -> None:
        """Read from the reader's position to the end of the order; raises Stop when stopped."""
        shared, txn, n = self._shared, self._txn, len(self._schedule)
        if self._probe is not None:
            schedule = self._schedule
            hints = ExtentHints(group_prefix(schedule.namespace_id, schedule.fingerprint, schedule.depth),
                                schedule.sample_ids, schedule.variants)
            self._prober = Prober(self._probe, self._store.probe, self.key, n, self._probe_bytes,
                                  paused=self._guess.warm, hints=hints)
        prober = self._prober
        try:
            while shared.read < n:
                if shared.stopping:
                    raise Stop
                if shared.read - shared.served >= _readahead.MAX_AHEAD_ENTRIES:
                    txn.close()
                    self._wait_until(lambda: shared.read - shared.served < _readahead.MAX_AHEAD_ENTRIES, True)
                if self._handover.claimed and not self._carry:
                    txn.close()
                    self._handover.park()
                    continue
                if not self._carry and self._warm_without_consumer():
                    txn.close()
                    grace = self._grace_until - time.monotonic()
                    self._wait_until(lambda: not self._warm_without_consumer(), timeout=grace if grace > 0 else None)
                    continue
                pos = shared.read
                if prober is not None:
                    prober.advance(pos, self._bytes // self._entries if self._entries else 0)
                self._handover.hinting = prober is not None and prober.active
                session = txn.open()
                # A run of entries whose bytes the budget has now: one reservation, one publish.
                if self._carry or not self._read_run(session, pos, min(n, pos + RUN,
                                                                       shared.served + _readahead.MAX_AHEAD_ENTRIES)):
                    self._read_one(session, pos)
        finally:
            self._schedule.counters.add(read_bytes=self._unflushed)
            txn.close()
            self._budget.release(shared, self._carry)
            if prober is not None:
                prober.close()

    def _read_one(self, session: ReadSession, pos: int) -> None:
        """Read the entry at ``pos``, waiting for its budget bytes (the transaction closed meanwhile: it is
        looked up again, its bytes carried)."""
        budget, shared = self._budget, self._shared
        key = self.key(pos)
        extent = session.locate(key)
        if extent is None:
            budget.release(shared, self._carry)
            self._carry = 0
            self._publish(pos, [Slot()])
            return
        need = extent.read_bytes or extent.length
        if self._carry >= need:
            budget.release(shared, self._carry - need)
        else:
            self._reserve(need - self._carry)
        self._carry = 0
        if not self._txn.is_open(session):  # waited with the transaction closed: look the key up again
            self._carry = need
            return
        self._publish(pos, [self._read(session, key, extent, need)])
        self._txn.tick()

    def _read(self, session: ReadSession, key: bytes, extent, need: int) -> Slot:
        """The entry at ``extent`` as a slot holding ``need`` budget bytes (given back if the read fails);
        counted as read."""
        try:
            data = session.read(key, extent)
        except BaseException:
            self._budget.release(self._shared, need)
            raise
        if self._prober is not None:
            self._prober.saw_read(session.last_resident)
        self._count(1, len(data))
        return Slot(need, data, served_size(data))

    def _count(self, entries: int, nbytes: int) -> None:
        self._entries += entries
        self._bytes += nbytes
        self._unflushed += nbytes
        if self._entries - self._flushed_at >= _COUNT_EVERY:
            self._schedule.counters.add(read_bytes=self._unflushed)
            self._unflushed, self._flushed_at = 0, self._entries

    def _reserve(self, n: int) -> None:
        """Take ``n`` budget bytes; close the read transaction before waiting for them."""
        shared, budget = self._shared, self._budget
        if n > budget.limit:
            raise BudgetExceeded(
                f"entry at position {shared.read} of schedule {self._schedule.schedule_id!r} needs {n} bytes in "
                f"memory, more than the whole prefetch budget of {budget.limit} bytes; raise --prefetch-bytes"
            )
        if budget.try_acquire(shared, n):
            return
        self._txn.close()
        # Without a consumer, wait for the bytes or for a consumer to attach (a Fetch reuses this reader).
        if not shared.attached and budget.acquire(shared, n, lambda: shared.stopping or shared.attached):
            return
        if shared.stopping:
            raise Stop
        # Its consumer waits: read-ahead without one gives its bytes back (on_starved), and gets none while this
        # reader waits, so what is given back comes here.
        with budget.first(shared):
            self._on_starved(shared, n)
            if not budget.acquire(shared, n, lambda: shared.stopping):
                raise Stop

    def _read_run(self, session: ReadSession, start: int, stop: int) -> bool:
        """Read positions ``start..stop-1`` while the budget has their bytes now, and publish them at once;
        False (nothing read) when the first one's bytes are not free."""
        budget, shared = self._budget, self._shared
        values = session.copy_run([self.key(pos) for pos in range(start, stop)])
        if values is not None:  # in the page cache: copied in one call, taken if the budget has them now
            sizes = [0 if v is None else len(v) for v in values]
            if budget.try_acquire(shared, sum(sizes)):
                if self._prober is not None:
                    self._prober.saw_read(True)
                self._count(sum(v is not None for v in values), sum(sizes))
                slots = [Slot() if v is None else Slot(n, v, served_size(v)) for v, n in zip(values, sizes)]
                self._publish(start, slots)
                self._txn.tick(len(values))
                return True
        slots = []
        try:
            for pos in range(start, stop):
                key = self.key(pos)
                extent = session.locate(key)
                if extent is None:
                    slots.append(Slot())
                    continue
                need = extent.read_bytes or extent.length
                if need > budget.limit or not budget.try_acquire(shared, need):
                    break  # _read_one waits for it
                slots.append(self._read(session, key, extent, need))
        finally:  # what was read is served, also before an error
            if slots:
                self._publish(start, slots)
        if slots:
            self._txn.tick(len(slots))
        return bool(slots)

    def _publish(self, start: int, slots: list[Slot]) -> None:
        if not self._shared.publish(start, slots):
            self._budget.release(self._shared, sum(slot.held for slot in slots))
            raise Stop

    def _warm_without_consumer(self) -> bool:
        """Whether to stop reading ahead until a consumer attaches: the group's values are in the page
        cache, and a run is read already or the consumer may still come first (``_ATTACH_GRACE_S``). Over
        shared memory the consumer then reads them itself (DirectRun); read ahead, each would be copied
        twice, and a first frame cut where the read-ahead ends splits a batch between two frames (the
        client copies it once more to join them)."""
        shared = self._shared
        return (self._guess.warm and not shared.attached and self._store.config.explicit_reads
                and (shared.read - shared.served >= RUN or time.monotonic() < self._grace_until))

    def _wait_until(self, ready: Callable[[], bool], reader_waits: bool = False, *,
                    timeout: float | None = None) -> None:
        """Wait until ``ready()`` (or ``timeout`` seconds), the transaction closed; ``reader_waits``: for the
        consumer. Stop if stopping."""
        shared = self._shared
        with shared.cond:
            shared.reader_waits = reader_waits
            shared.cond.wait_for(lambda: shared.stopping or ready(), timeout)
            shared.reader_waits = False
        if shared.stopping:
            raise Stop
