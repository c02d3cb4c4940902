"""The reader thread of one schedule: walks the order, takes budget, reads entries as stored, publishes them."""

from __future__ import annotations

from concurrent.futures import Executor
from typing import TYPE_CHECKING, Callable

from actcache.daemon.prefetch import _readahead
from actcache.daemon.prefetch._budget import MemoryBudget
from actcache.daemon.prefetch._handover import Handover
from actcache.daemon.prefetch._lookahead import Prober, ShortTransaction
from actcache.daemon.prefetch._readahead import ReadAhead, Slot, Stop
from actcache.daemon.prefetch._schedule import Schedule
from actcache.daemon.store import ExtentHints, PageCacheGuess
from actcache.errors import BudgetExceeded
from actcache.keys import group_prefix
from actcache.served import served_size

if TYPE_CHECKING:
    from actcache.daemon.store import Store

__all__ = ["ReadLoop"]

# Entries read and published together while the budget has their bytes (one lock and wake-up check a run).
RUN = 32
_KEY_BLOCK = 512


class ReadLoop:
    """Reads a schedule's entries ahead of its consumer, on the reader's own thread.

    Each position is looked up and read as stored (no decoding here), its
    bytes reserved in the shared budget first, then published in order into
    the ``ReadAhead``. Invariants: this thread is the only one that moves
    ``read`` forward while not parked; it holds at most one reservation
    (``carry``) besides its slots' bytes, and closes its read transaction
    before any wait (budget, consumer, attach, park), so a waiting reader
    pins no pages. It stops (``Stop``) as soon as the reader is stopping.
    """

    def __init__(self, schedule: Schedule, shared: ReadAhead, handover: Handover, *, store: Store,
                 budget: MemoryBudget, probe_pool: Executor | None, probe_bytes: int, guess: PageCacheGuess,
                 on_starved: Callable[[ReadAhead, int], None] | None) -> None:
        """The budget counts this reader's bytes under ``shared`` (its ScheduleReader)."""
        self._owner, self._schedule, self._shared, self._handover = shared, schedule, shared, handover
        self._store, self._budget, self._probe, self._probe_bytes = store, budget, probe_pool, probe_bytes
        self._guess, self._on_starved = guess, on_starved
        self._keys: dict[int, list[bytes]] = {}

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
        shared, budget, owner = self._shared, self._budget, self._owner
        n = len(self._schedule)
        txn = ShortTransaction(self._store, self._guess)
        prober = Prober(self._probe, self._store.probe, self.key, n, self._probe_bytes, paused=self._guess.warm,
                        hints=self._extent_hints()) if self._probe else None
        carry = 0  # budget bytes already held for the entry at ``read`` (taken while the txn was closed)
        read_entries = read_total = unflushed = 0
        try:
            while shared.read < n:
                if shared.stopping:
                    raise Stop
                if shared.read - shared.served >= _readahead.MAX_AHEAD_ENTRIES:
                    txn.close()
                    self._wait_for_consumer()
                if self._handover.claimed and not carry:
                    txn.close()
                    self._handover.park()
                    continue
                if not carry and self._warm_without_consumer():
                    txn.close()
                    self._wait_for_attach()
                    continue
                pos = shared.read
                if prober is not None:
                    prober.advance(pos, read_total // read_entries if read_entries else 0)
                self._handover.hinting = prober is not None and prober.active
                session = txn.open()
                if not carry:  # a run of entries whose bytes the budget has now: one reservation, one publish
                    got = self._read_run(session, pos, min(n, pos + RUN, shared.served + _readahead.MAX_AHEAD_ENTRIES),
                                         prober)
                    if got:
                        read_entries += got[0]
                        read_total += got[1]
                        self._schedule.counters.add(read_bytes=got[1])
                        txn.tick(got[2])
                        continue
                key = self.key(pos)
                extent = session.locate(key)
                if extent is None:
                    budget.release(owner, carry)
                    carry = 0
                    self._publish(pos, [Slot()])
                    continue
                need = extent.read_bytes or extent.length
                if carry >= need:
                    budget.release(owner, carry - need)
                else:
                    self._reserve(need - carry, txn)
                carry = 0
                if not txn.is_open(session):  # waited with the transaction closed: look the key up again
                    carry = need
                    continue
                data = session.read(key, extent)
                if prober is not None:
                    prober.saw_read(session.last_resident)
                read_entries += 1
                read_total += len(data)
                unflushed += len(data)
                if read_entries % 64 == 0:
                    self._schedule.counters.add(read_bytes=unflushed)
                    unflushed = 0
                self._publish(pos, [Slot(need, data, served_size(data))])
                txn.tick()
        finally:
            self._schedule.counters.add(read_bytes=unflushed)
            txn.close()
            budget.release(owner, carry)
            if prober is not None:
                prober.close()

    def _reserve(self, n: int, txn: ShortTransaction) -> None:
        """Take ``n`` budget bytes; close the read transaction before waiting for them."""
        shared, budget, owner = self._shared, self._budget, self._owner
        if n > budget.limit:
            raise BudgetExceeded(
                f"entry at position {shared.read} of schedule {self._schedule.schedule_id!r} needs {n} bytes in "
                f"memory, more than the whole prefetch budget of {budget.limit} bytes; raise --prefetch-bytes"
            )
        if budget.try_acquire(owner, n):
            return
        txn.close()
        # Without a consumer, wait for the bytes or for a consumer to attach (a Fetch reuses this reader).
        if not shared.attached and budget.acquire(owner, n, lambda: shared.stopping or shared.attached):
            return
        if shared.stopping:
            raise Stop
        # Its consumer waits: read-ahead without one gives its bytes back (on_starved), and gets none while this
        # reader waits, so what is given back comes here.
        with budget.first(owner):
            if self._on_starved is not None:
                self._on_starved(owner, n)
            if not budget.acquire(owner, n, lambda: shared.stopping):
                raise Stop

    def _read_run(self, session, start: int, stop: int, prober: Prober | None) -> tuple[int, int, int] | None:
        """Read positions ``start..stop-1`` while the budget has their bytes now, and publish them at once;
        ``(entries read, bytes read, positions)``, or None when the first one's bytes are not free."""
        budget, owner = self._budget, self._owner
        values = session.copy_run([self.key(pos) for pos in range(start, stop)])
        if values is not None:  # in the page cache: copied in one call, taken if the budget has them now
            sizes = [0 if v is None else len(v) for v in values]
            if budget.try_acquire(owner, sum(sizes)):
                if prober is not None:
                    prober.saw_read(True)
                slots = [Slot() if v is None else Slot(n, v, served_size(v)) for v, n in zip(values, sizes)]
                self._publish(start, slots)
                return sum(v is not None for v in values), sum(sizes), len(slots)
        slots, read, nbytes = [], 0, 0
        try:
            for pos in range(start, stop):
                key = self.key(pos)
                extent = session.locate(key)
                if extent is None:
                    slots.append(Slot())
                    continue
                need = extent.read_bytes or extent.length
                if need > budget.limit or not budget.try_acquire(owner, need):
                    break  # the entry-by-entry path waits for it
                data = session.read(key, extent)
                if prober is not None:
                    prober.saw_read(session.last_resident)
                read += 1
                nbytes += len(data)
                slots.append(Slot(need, data, served_size(data)))
        except BaseException:  # what was read is served before the error
            if slots:
                self._publish(start, slots)
            raise
        if not slots:
            return None
        self._publish(start, slots)
        return read, nbytes, len(slots)

    def _publish(self, start: int, slots: list[Slot]) -> None:
        if not self._shared.publish(start, slots):
            self._budget.release(self._owner, sum(slot.held for slot in slots))
            raise Stop

    def _warm_without_consumer(self) -> bool:
        """Whether to stop reading ahead until a consumer attaches: the group's values are in the page
        cache (the guess carries over from its last schedule) and a run is read already. Over shared
        memory the consumer then reads them itself, one pass per frame (DirectRun); read ahead, each
        would be copied twice and served entry by entry."""
        shared = self._shared
        return (self._guess.warm and not shared.attached and self._store.config.explicit_reads
                and shared.read - shared.served >= RUN)

    def _wait_for_attach(self) -> None:
        shared = self._shared
        with shared.cond:
            shared.cond.wait_for(lambda: shared.stopping or shared.attached)
        if shared.stopping:
            raise Stop

    def _wait_for_consumer(self) -> None:
        shared = self._shared
        with shared.cond:
            shared.reader_waits = True
            shared.cond.wait_for(lambda: shared.stopping or shared.read - shared.served < _readahead.MAX_AHEAD_ENTRIES)
            shared.reader_waits = False
        if shared.stopping:
            raise Stop

    def _extent_hints(self) -> ExtentHints:
        schedule = self._schedule
        prefix = group_prefix(schedule.namespace_id, schedule.fingerprint, schedule.depth)
        return ExtentHints(prefix, schedule.sample_ids, schedule.variants)
