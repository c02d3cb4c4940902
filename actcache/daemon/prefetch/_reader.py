"""One schedule reader: reads a pushed order ahead of its consumer and serves it as Fetch frames.

Lifecycle (ReaderState)::

    WAITING --> READING --> READ_ALL --> DONE
       |           |           |
       +-----------+-----------+--> CANCELLED   consumer gone, schedule replaced,
                   |           |                newer Fetch, daemon stopping
                   +-----------+--> FAILED      the store failed; the consumer gets
                                                the error after the entries read before it

Threads: the reader's own thread walks the order (lookups, budget,
``pread``) and buffers entries as stored; the probe pool runs lookups ahead
(see actcache.daemon.store._extents); the consumer, the gRPC thread running
``frames()`` or ``batches()``, verifies and decompresses each frame's
entries as it serves them, into the frame or shared-memory slots, with the
decode pool taking part of a large frame. Decoding there costs no hand-off
per entry, and zstd decompresses a whole batch per call: handing every few
entries to a pool thread and back, or releasing and retaking the
interpreter lock for every entry's decompression, cost more CPU than the
decompression itself on small entries. A warm stream over shared memory
skips the reader thread altogether: it parks, and the consumer reads each
frame from the store itself (``DirectRun``, _direct.py). A schedule of a
group already warm (the next epoch's, pushed ahead) reads at most one run
before its consumer attaches, and the consumer may claim it while it still
waits for its budget turn: it is read by its Fetch from its first entry.

One class of about 500 lines: the reader thread, its slots, the consumer's frames and the hand-over to
direct runs (the reader parks while the consumer reads) share one condition variable.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from actcache._proto import actcache_pb2 as pb
from actcache.served import served_size
from actcache.daemon.prefetch._budget import MemoryBudget
from actcache.daemon.prefetch._direct import DirectRun
from actcache.daemon.prefetch._lookahead import Prober, ShortTransaction
from actcache.daemon.prefetch._schedule import Schedule
from actcache.daemon.prefetch._served import ServedBatch
from actcache.daemon.store import ExtentHints, PageCacheGuess
from actcache.errors import ActCacheError, BudgetExceeded, InvalidRequest, StoreError
from actcache.keys import group_prefix
from actcache.rpc import encode_frame

if TYPE_CHECKING:
    from actcache.daemon.store import Store

__all__ = ["DirectRun", "MAX_AHEAD_ENTRIES", "ReaderSnapshot", "ReaderState", "ScheduleReader", "ServedBatch"]

# Entries a reader keeps read ahead of its consumer at most (misses hold no
# budget bytes, so the budget alone would not bound them).
MAX_AHEAD_ENTRIES = 1 << 16
# A frame waits up to _LINGER_S for _FILL_BYTES (or _FILL_ENTRIES) of ready entries: every
# frame costs a gRPC message and wake-ups on both sides, whatever it holds.
_FILL_BYTES = 1 << 20
_FILL_ENTRIES = 1024
_LINGER_S = 0.005
# Entries read and published together while the budget has their bytes (one lock and wake-up check a run).
_RUN = 32

log = logging.getLogger(__name__)

_KEY_BLOCK = 512


class ReaderState(enum.Enum):
    WAITING = "waiting"
    READING = "reading"
    READ_ALL = "read_all"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


_ENDED = (ReaderState.DONE, ReaderState.CANCELLED, ReaderState.FAILED)


@dataclass(frozen=True, slots=True)
class ReaderSnapshot:
    """Positions and memory of a reader at one instant (start <= served <= ready <= read <= length)."""

    state: ReaderState
    attached: bool
    start: int
    served: int
    ready: int
    read: int
    length: int
    buffered_bytes: int

    @property
    def read_ahead_entries(self) -> int:
        return self.read - self.served


class _Slot:
    """One read position: the entry as stored (None = a miss), its budget bytes, its size as served."""

    __slots__ = ("held", "data", "nbytes")

    def __init__(self, held: int = 0, data=None, nbytes: int = 0) -> None:
        self.held = held
        self.data = data
        self.nbytes = nbytes


class _Stop(Exception):
    """The reader was cancelled or failed; its thread ends."""


class ScheduleReader:
    """Reads ``schedule`` from ``start`` ahead of the consumer within the shared budget.

    Invariants (under ``_cond``): ``start <= served <= ready <= read <=
    len(schedule)`` and ``read - served <= MAX_AHEAD_ENTRIES``; positions in
    ``[served, read)`` have a slot; an entry is ready as soon as it is read
    (``ready == read`` while reading; a failure moves ``ready`` back to where
    serving ends). The budget bytes this reader holds equal the bytes of its
    slots plus at most one reservation for the entry being read, so the
    budget's ``used <= limit`` bounds its memory. A slot is dropped as soon as
    its frame is built. A cancelled reader frees every slot at once.
    """

    def __init__(
        self,
        schedule: Schedule,
        start: int,
        *,
        store: Store,
        budget: MemoryBudget,
        decode_pool: Executor | None,
        probe_pool: Executor | None,
        probe_bytes: int,
        attached: bool,
        on_change: Callable[["ScheduleReader"], None],
        on_starved: Callable[["ScheduleReader", int], None] | None = None,
        guess: PageCacheGuess | None = None,
    ) -> None:
        self.schedule = schedule
        self.start = start
        self.attached = attached
        #: Set by the prefetcher (under the budget's condition): may this reader read now?
        self.allowed = attached
        #: Set by the prefetcher (same condition): gives its bytes back to a starving consumer; never attached.
        self.reclaimed = False
        self.state = ReaderState.WAITING
        self.served = self.ready = self.read = start
        self._store = store
        self._budget = budget
        self._decode = decode_pool
        self._probe = probe_pool
        self._probe_bytes = probe_bytes
        self._on_change = on_change
        self._on_starved = on_starved
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        #: Positions from here on are never served (the length, or where the reader failed).
        self._end = len(schedule)
        self._ready_bytes = 0  # bytes of the ready, unserved entries
        self._reader_waits = False  # the reader waits for the consumer (MAX_AHEAD_ENTRIES)
        #: What the consumer waits for: None (not waiting), "any" ready entry, or a frame's "fill".
        self._consumer_waits: str | None = None
        self._fill_bytes = _FILL_BYTES
        self._error: ActCacheError | None = None
        self._stopping = False
        self._keys: dict[int, list[bytes]] = {}
        self._guess = guess or PageCacheGuess()  # whether this stream's values are in the page cache
        #: Direct serving (see ``batches``): the consumer claimed the positions from ``read`` on, and the
        #: reader thread acknowledged it (it holds no transaction and reads nothing until released).
        self._claimed = self._parked = False
        self._claim_from = 0  # after a run was given back: not before the reader has read this far
        # The reader's probes still tell the kernel what to read (cold data); a warm group's start paused.
        self._hinting = not self._guess.warm
        self._thread: threading.Thread | None = None  # runs the reading loop (``begin``)

    # ---- lifecycle -------------------------------------------------------

    def begin(self) -> None:
        """Start reading, on a thread of its own."""
        self._thread = threading.Thread(target=self._run, name=f"actcache-reader-{self.schedule.schedule_id}",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _set_state(self, state: ReaderState) -> None:
        """Caller holds ``_cond``; the prefetcher is told after the lock is dropped."""
        self.state = state
        self._cond.notify_all()

    def cancel(self, error: ActCacheError | None = None) -> None:
        """End the reader (a failed one too) and free its ready entries now.

        ``error`` goes to a consumer still listening; None ends its stream quietly.
        """
        with self._cond:
            if self.state in (ReaderState.DONE, ReaderState.CANCELLED):
                return
            self._stopping = True
            self._error = error
            freed = sum(slot.held for slot in self._slots.values())
            self._slots.clear()
            self.ready = self.served
            self._ready_bytes = 0
            self._set_state(ReaderState.CANCELLED)
        self._budget.release(self, freed)
        self._on_change(self)
        self._budget.wake()

    def _fail(self, exc: BaseException, at: int | None = None) -> None:
        """End reading with ``exc``: the consumer still gets the entries before position ``at``
        (default: everything read so far), then the error."""
        at = self.read if at is None else at
        error = exc if isinstance(exc, ActCacheError) else StoreError(
            f"reading schedule {self.schedule.schedule_id!r} failed at position {at}: {exc!r}"
        )
        if not isinstance(exc, ActCacheError):
            log.error("schedule reader failed", exc_info=exc)
        freed = 0
        with self._cond:
            if self.state in _ENDED:
                return
            self._stopping = True
            self._error = error
            self._end = min(self._end, at)
            for pos in [p for p in self._slots if p >= self._end]:
                freed += self._slots.pop(pos).held
            self.ready = min(self.ready, self._end)
            self._ready_bytes = sum(self._slots[p].nbytes for p in range(self.served, self.ready))
            self._set_state(ReaderState.FAILED)
        self._budget.release(self, freed)
        self._on_change(self)
        self._budget.wake()

    def snapshot(self) -> ReaderSnapshot:
        with self._cond:
            return ReaderSnapshot(
                self.state, self.attached, self.start, self.served, self.ready, self.read,
                len(self.schedule), self._budget.held(self),
            )

    # ---- the reader thread -----------------------------------------------

    def _run(self) -> None:
        try:
            with self._budget.cond:
                self._budget.cond.wait_for(lambda: self._stopping or self.allowed)
            with self._cond:
                if self._stopping:
                    return
                self._set_state(ReaderState.READING)
            self._on_change(self)
            self._read_all()
            with self._cond:
                if self.state is ReaderState.READING:
                    self._set_state(ReaderState.READ_ALL)
            self._on_change(self)
        except _Stop:
            return  # cancelled, or failed and already ended by _fail
        except BaseException as exc:  # delivered to the consumer, never a silent stall
            self._fail(exc)

    def _key(self, pos: int) -> bytes:
        block = pos // _KEY_BLOCK
        keys = self._keys.get(block)
        if keys is None:  # probes ask ahead of the reader: keep blocks from the reader's on
            for old in [b for b in self._keys if b < self.read // _KEY_BLOCK]:
                del self._keys[old]
            start = block * _KEY_BLOCK
            keys = self._keys[block] = self.schedule.keys(start, min(len(self.schedule), start + _KEY_BLOCK))
        return keys[pos - block * _KEY_BLOCK]

    def _reserve(self, n: int, txn: ShortTransaction) -> None:
        """Take ``n`` budget bytes; close the read transaction before waiting for them."""
        if n > self._budget.limit:
            raise BudgetExceeded(
                f"entry at position {self.read} of schedule {self.schedule.schedule_id!r} needs {n} bytes in "
                f"memory, more than the whole prefetch budget of {self._budget.limit} bytes; raise --prefetch-bytes"
            )
        if self._budget.try_acquire(self, n):
            return
        txn.close()
        # Without a consumer, wait for the bytes or for a consumer to attach (a Fetch reuses this reader).
        if not self.attached and self._budget.acquire(self, n, lambda: self._stopping or self.attached):
            return
        if self._stopping:
            raise _Stop
        # Its consumer waits: read-ahead without one gives its bytes back (on_starved), and gets none while this
        # reader waits, so what is given back comes here.
        with self._budget.first(self):
            if self._on_starved is not None:
                self._on_starved(self, n)
            if not self._budget.acquire(self, n, lambda: self._stopping):
                raise _Stop

    def _read_all(self) -> None:
        n = len(self.schedule)
        txn = ShortTransaction(self._store, self._guess)
        prober = Prober(self._probe, self._store.probe, self._key, n, self._probe_bytes, paused=self._guess.warm,
                        hints=self._extent_hints()) if self._probe else None
        carry = 0  # budget bytes already held for the entry at ``read`` (taken while the txn was closed)
        read_entries = read_total = unflushed = 0
        try:
            while self.read < n:
                if self._stopping:
                    raise _Stop
                if self.read - self.served >= MAX_AHEAD_ENTRIES:
                    txn.close()
                    self._wait_for_consumer()
                if self._claimed and not carry:
                    txn.close()
                    self._park()
                    continue
                if not carry and self._warm_without_consumer():
                    txn.close()
                    self._wait_for_attach()
                    continue
                pos = self.read
                if prober is not None:
                    prober.advance(pos, read_total // read_entries if read_entries else 0)
                self._hinting = prober is not None and prober.active
                session = txn.open()
                if not carry:  # a run of entries whose bytes the budget has now: one reservation, one publish
                    got = self._read_run(session, pos, min(n, pos + _RUN, self.served + MAX_AHEAD_ENTRIES), prober)
                    if got:
                        read_entries += got[0]
                        read_total += got[1]
                        self.schedule.counters.add(read_bytes=got[1])
                        txn.tick(got[2])
                        continue
                key = self._key(pos)
                extent = session.locate(key)
                if extent is None:
                    self._budget.release(self, carry)
                    carry = 0
                    self._publish(pos, _Slot())
                    continue
                need = extent.read_bytes or extent.length
                if carry >= need:
                    self._budget.release(self, carry - need)
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
                    self.schedule.counters.add(read_bytes=unflushed)
                    unflushed = 0
                self._publish(pos, _Slot(need, data, served_size(data)))
                txn.tick()
        finally:
            self.schedule.counters.add(read_bytes=unflushed)
            txn.close()
            self._budget.release(self, carry)
            if prober is not None:
                prober.close()

    def _extent_hints(self) -> ExtentHints:
        schedule = self.schedule
        prefix = group_prefix(schedule.namespace_id, schedule.fingerprint, schedule.depth)
        return ExtentHints(prefix, schedule.sample_ids, schedule.variants)

    def _read_run(self, session, start: int, stop: int, prober) -> tuple[int, int, int] | None:
        """Read positions ``start..stop-1`` while the budget has their bytes now, and publish them at once;
        ``(entries read, bytes read, positions)``, or None when the first one's bytes are not free."""
        values = session.copy_run([self._key(pos) for pos in range(start, stop)])
        if values is not None:  # in the page cache: copied in one call, taken if the budget has them now
            sizes = [0 if v is None else len(v) for v in values]
            if self._budget.try_acquire(self, sum(sizes)):
                if prober is not None:
                    prober.saw_read(True)
                slots = [_Slot() if v is None else _Slot(n, v, served_size(v)) for v, n in zip(values, sizes)]
                self._publish_run(start, slots)
                return sum(v is not None for v in values), sum(sizes), len(slots)
        slots, read, nbytes = [], 0, 0
        try:
            for pos in range(start, stop):
                key = self._key(pos)
                extent = session.locate(key)
                if extent is None:
                    slots.append(_Slot())
                    continue
                need = extent.read_bytes or extent.length
                if need > self._budget.limit or not self._budget.try_acquire(self, need):
                    break  # the entry-by-entry path waits for it
                data = session.read(key, extent)
                if prober is not None:
                    prober.saw_read(session.last_resident)
                read += 1
                nbytes += len(data)
                slots.append(_Slot(need, data, served_size(data)))
        except BaseException:  # what was read is served before the error
            if slots:
                self._publish_run(start, slots)
            raise
        if not slots:
            return None
        self._publish_run(start, slots)
        return read, nbytes, len(slots)

    def _publish_run(self, start: int, slots: list[_Slot]) -> None:
        """``_publish`` of consecutive positions from ``start``, under one lock."""
        with self._cond:
            if self._stopping:
                self._budget.release(self, sum(slot.held for slot in slots))
                raise _Stop
            for pos, slot in enumerate(slots, start=start):
                self._slots[pos] = slot
                self._ready_bytes += slot.nbytes
            self.read = self.ready = start + len(slots)
            if self._consumer_waits == "any" or self._consumer_waits == "fill" and self._frame_filled():
                self._cond.notify_all()

    def _park(self) -> None:
        """Wait while the consumer serves directly (the reader's position moves on under it)."""
        with self._cond:
            self._parked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._stopping or not self._claimed)
            self._parked = False
        if self._stopping:
            raise _Stop

    def _warm_without_consumer(self) -> bool:
        """Whether to stop reading ahead until a consumer attaches: the group's values are in the page
        cache (the guess carries over from its last schedule) and a run is read already. Over shared
        memory the consumer then reads them itself, one pass per frame (DirectRun); read ahead, each
        would be copied twice and served entry by entry (a fifth of a 2,048-entry epoch pushed ahead,
        before its Fetch took over)."""
        return (self._guess.warm and not self.attached and self._store.config.explicit_reads
                and self.read - self.served >= _RUN)

    def _wait_for_attach(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or self.attached)
        if self._stopping:
            raise _Stop

    def consumer_attached(self) -> None:
        """A Fetch took this reader over (``attached`` is set): wake it if it waits for one."""
        with self._cond:
            self._cond.notify_all()

    def _wait_for_consumer(self) -> None:
        with self._cond:
            self._reader_waits = True
            self._cond.wait_for(lambda: self._stopping or self.read - self.served < MAX_AHEAD_ENTRIES)
            self._reader_waits = False
        if self._stopping:
            raise _Stop

    def _publish(self, pos: int, slot: _Slot) -> None:
        with self._cond:
            if self._stopping:
                self._budget.release(self, slot.held)
                raise _Stop
            self._slots[pos] = slot
            self.read = self.ready = pos + 1
            self._ready_bytes += slot.nbytes
            # Wake the consumer only when what it waits for is there (a wake-up per entry costs more
            # CPU than the entry's decoding); state changes and the end of reading wake it in _set_state.
            if self._consumer_waits == "any" or self._consumer_waits == "fill" and self._frame_filled():
                self._cond.notify_all()

    def _frame_filled(self) -> bool:
        """A frame's worth is ready. Caller holds ``_cond``."""
        return self._ready_bytes >= self._fill_bytes or self.ready - self.served >= _FILL_ENTRIES

    def _served_done(self, held: int) -> Callable[[dict], None]:
        """What a served frame calls once: give back its ``held`` budget bytes and count it."""

        def done(counts: dict) -> None:
            self._budget.release(self, held)
            self.schedule.counters.add(**counts)

        return done

    def _discard_corrupt(self, pos: int, exc: InvalidRequest) -> None:
        log.warning("schedule %r position %d: stored entry is corrupt (%s); serving a miss and deleting it",
                    self.schedule.schedule_id, pos, exc)
        try:
            self._store.discard_corrupt(self.schedule.keys(pos, pos + 1))
        except ActCacheError as delete_error:
            log.warning("could not delete the corrupt entry: %s", delete_error)

    # ---- the consumer ----------------------------------------------------

    def frames(self, max_frame_bytes: int) -> Iterator[bytes]:
        """Fetch frames (entries in the payload) from ``start`` to the end; see ``batches``."""
        for batch in self.batches(max_frame_bytes):
            parts = batch.decode()
            frame = encode_frame(batch.header.SerializeToString(), [p for entry in parts for p in entry])
            batch.finish()
            yield frame

    def batches(self, max_frame_bytes: int, *, direct_entries: int = 0) -> Iterator[ServedBatch | DirectRun]:
        """The entries of one frame at a time, from ``start`` to the end.

        The consumer decodes the entries (``decode`` or ``decode_into``), then
        calls ``finish()`` (which releases their budget bytes and counts them;
        closing the generator does it too). Raises the reader's error after
        the entries read before it failed; returns early, quietly, if
        cancelled without an error for the consumer.

        ``direct_entries``: once this stream's values are in the page cache
        (the reader's guess is warm and its probes have paused: the kernel
        needs no hints), the reader thread stops after its current run; what it read ahead is
        served first, then the consumer gets ``DirectRun``s of up to that many
        positions to read from the store itself, in one pass per frame (see
        _direct.py), until it gives reading back (``DirectRun.give_back``) or
        the generator ends.
        """
        try:
            yield from self._batches(max_frame_bytes, direct_entries)
        finally:
            self._release_claim()

    def _may_claim(self, direct_entries: int) -> bool:
        """Whether the consumer may take over reading: it serves straight from the store. Caller holds ``_cond``."""
        # WAITING: the reader thread waits for its budget turn; it parks as soon as it starts reading
        return (direct_entries > 0 and not self._claimed and self.state in (ReaderState.WAITING, ReaderState.READING)
                and not self._hinting
                and self.read >= self._claim_from and self._guess.warm and self._store.config.explicit_reads)

    def _release_claim(self) -> None:
        with self._cond:
            if self._claimed:
                self._claimed = False
                self._cond.notify_all()

    def _give_back(self, position: int) -> None:
        """The consumer could not serve ``position`` directly: the reader thread reads it (and on)."""
        with self._cond:
            self._claim_from = position + 1
        self._release_claim()

    def _direct_done(self, run: DirectRun, served: int, counts: dict) -> None:
        """The consumer served ``served`` positions of ``run`` from the store."""
        ended = False
        with self._cond:
            self.served = self.ready = self.read = run.start + served
            if self.read >= len(self.schedule) and self.state is ReaderState.READING:
                self._set_state(ReaderState.READ_ALL)
                ended = True
        self.schedule.counters.add(**counts)
        if ended:
            self._on_change(self)

    def _batches(self, max_frame_bytes: int, direct_entries: int) -> Iterator[ServedBatch | DirectRun]:
        schedule = self.schedule
        # Over shared memory the client sizes frames to one batch (it needs all of it): fill them whole.
        self._fill_bytes = max_frame_bytes if direct_entries else min(max_frame_bytes, _FILL_BYTES)
        while True:
            direct_at = None
            with self._cond:
                def over() -> bool:  # nothing more will become ready for this consumer
                    return (self.state is ReaderState.CANCELLED or self.served >= self._end
                            or self.state is ReaderState.FAILED and self.served not in self._slots)

                def filled() -> bool:  # a frame's worth is ready, or no more is coming soon
                    return (self._frame_filled() or over() or self._parked  # parked: this consumer reads on
                            or self.state is not ReaderState.READING and self.ready >= min(self.read, self._end))

                stalled, waited = False, 0.0
                if self._may_claim(direct_entries):
                    self._claimed = True  # the reader thread parks once its current run is published
                if self.served == self.ready and not over() and not self._parked:
                    stalled, t0 = True, time.monotonic()
                    self._consumer_waits = "any"
                    self._cond.wait_for(lambda: self.served < self.ready or over() or self._parked)
                    waited = time.monotonic() - t0
                if self._parked and self.served == self.ready and not over():
                    direct_at = self.served
                else:
                    if not filled():
                        # Less than a frame is ready: rather than a small frame (costly on both sides),
                        # give the reader a moment to fill a reasonable one.
                        self._consumer_waits = "fill"
                        self._cond.wait_for(filled, _LINGER_S)
                    if self.served == self.ready:
                        self._consumer_waits = None
                        if self.state in (ReaderState.CANCELLED, ReaderState.FAILED):
                            if self._error is not None:
                                raise self._error
                            return
                        self._set_state(ReaderState.DONE)
                        break
                    start, taken, size = self.served, [], 0
                    while self.served < self.ready:
                        slot = self._slots[self.served]
                        if taken and size + slot.nbytes > max_frame_bytes:
                            break
                        taken.append(self._slots.pop(self.served))
                        size += slot.nbytes
                        self.served += 1
                    self._ready_bytes -= size
                self._consumer_waits = None
                if self._reader_waits:
                    self._cond.notify_all()
            if direct_at is not None:
                yield DirectRun(direct_at, min(self._end, direct_at + direct_entries), schedule=schedule, key=self._key,
                                store=self._store, guess=self._guess, done=self._direct_done,
                                give_back=self._give_back, discard=self._discard_corrupt, pool=self._decode)
                continue
            stop = start + len(taken)
            header = pb.EntriesHeader(
                start=start,
                sample_ids=schedule.sample_ids[start:stop].tolist(),
                variants=schedule.variants[start:stop].tolist() if schedule.variants is not None else [],
                lengths=[s.nbytes for s in taken],
            )
            counts = dict(ready_on_ask=len(taken) - stalled, stalls=int(stalled), stall_seconds=waited)
            batch = ServedBatch(header, [s.data for s in taken], pool=self._decode, discard=self._discard_corrupt,
                                done=self._served_done(sum(s.held for s in taken)), counts=counts)
            try:
                yield batch
            finally:
                batch.finish()
        self._on_change(self)
