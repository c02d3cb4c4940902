"""One schedule reader: reads a pushed order ahead of its consumer and serves it as Fetch frames.

Lifecycle (ReaderState)::

    WAITING --> READING --> READ_ALL --> DONE
       |           |           |
       +-----------+-----------+--> CANCELLED   consumer gone, schedule replaced,
                   |           |                newer Fetch, daemon stopping
                   +-----------+--> FAILED      the store failed; the consumer gets
                                                the error after the entries read before it

Threads: the reader's own thread walks the order (lookups, budget,
``pread``); a shared pool verifies and decompresses; the probe pool runs
lookups ahead (see actcache.daemon.extents); the consumer is the gRPC
thread running ``frames()``.
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
from actcache.codec import Codec, decoded_size, to_raw_entry
from actcache.daemon.budget import MemoryBudget
from actcache.daemon.lookahead import Prober, ShortTransaction
from actcache.daemon.schedule import Schedule
from actcache.errors import ActCacheError, BudgetExceeded, InvalidRequest, StoreError
from actcache.rpc import encode_frame

if TYPE_CHECKING:
    from actcache.daemon.store import Store

__all__ = ["MAX_AHEAD_ENTRIES", "ReaderSnapshot", "ReaderState", "ScheduleReader"]

# Entries a reader keeps read ahead of its consumer at most (misses hold no
# budget bytes, so the budget alone would not bound them).
MAX_AHEAD_ENTRIES = 1 << 16
# A frame waits up to _LINGER_S for _FILL_BYTES (or _FILL_ENTRIES) of ready entries: every
# frame costs a gRPC message and wake-ups on both sides, whatever it holds.
_FILL_BYTES = 1 << 20
_FILL_ENTRIES = 1024
_LINGER_S = 0.005

log = logging.getLogger(__name__)

_KEY_BLOCK = 512
# Entries (or bytes) verified and decompressed by one decode task.
_BATCH_ENTRIES = 8
_BATCH_BYTES = 512 << 10


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
    """One read position: pending until decoded, then ready with its parts (no parts = a miss)."""

    __slots__ = ("held", "parts", "nbytes", "ready", "corrupt")

    def __init__(self, held: int = 0, ready: bool = False) -> None:
        self.held = held
        self.parts: tuple = ()
        self.nbytes = 0
        self.ready = ready
        self.corrupt = False


class _Stop(Exception):
    """The reader was cancelled or failed; its thread ends."""


class ScheduleReader:
    """Reads ``schedule`` from ``start`` ahead of the consumer within the shared budget.

    Invariants (under ``_cond``): ``start <= served <= ready <= read <=
    len(schedule)`` and ``read - served <= MAX_AHEAD_ENTRIES``; positions in
    ``[served, read)`` have a slot, those below ``ready`` are ready; the budget bytes this reader holds equal the bytes of
    its slots plus at most one reservation for the entry being read, so the
    budget's ``used <= limit`` bounds its memory. A slot is dropped as soon as
    its frame is built. A cancelled reader frees every ready slot at once and
    each in-flight one when its decode ends.
    """

    def __init__(
        self,
        schedule: Schedule,
        start: int,
        *,
        store: Store,
        budget: MemoryBudget,
        decode_pool: Executor,
        probe_pool: Executor | None,
        probe_bytes: int,
        attached: bool,
        on_change: Callable[["ScheduleReader"], None],
        on_starved: Callable[["ScheduleReader", int], None] | None = None,
    ) -> None:
        self.schedule = schedule
        self.start = start
        self.attached = attached
        #: Set by the prefetcher (under the budget's condition): may this reader read now?
        self.allowed = attached
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
        self._thread = threading.Thread(
            target=self._run, name=f"actcache-reader-{schedule.schedule_id}", daemon=True
        )

    # ---- lifecycle -------------------------------------------------------

    def begin(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.ident is not None:
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
            freed = 0
            for pos in [p for p, slot in self._slots.items() if slot.ready]:
                freed += self._slots.pop(pos).held  # entries still decoding free themselves when done
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
            for pos in [p for p, slot in self._slots.items() if slot.ready and p >= self._end]:
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
            pass
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

    def _reserve(self, n: int, txn: ShortTransaction, batch: "_DecodeBatch") -> None:
        """Take ``n`` budget bytes; before waiting for them, close the read transaction and hand the
        decode pool what was read (the consumer needs it to free memory)."""
        if n > self._budget.limit:
            raise BudgetExceeded(
                f"entry at position {self.read} of schedule {self.schedule.schedule_id!r} needs {n} bytes in "
                f"memory, more than the whole prefetch budget of {self._budget.limit} bytes; raise --prefetch-bytes"
            )
        if self._budget.try_acquire(self, n):
            return
        txn.close()
        batch.flush()
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
        txn = ShortTransaction(self._store)
        batch = _DecodeBatch(self)
        prober = Prober(self._probe, self._store.probe, self._key, n, self._probe_bytes) if self._probe else None
        carry = 0  # budget bytes already held for the entry at ``read`` (taken while the txn was closed)
        read_entries = read_total = unflushed = 0
        try:
            while self.read < n:
                if self._stopping:
                    raise _Stop
                if self.read - self.served >= MAX_AHEAD_ENTRIES:
                    txn.close()
                    batch.flush()
                    self._wait_for_consumer()
                pos = self.read
                if prober is not None:
                    prober.advance(pos, read_total // read_entries if read_entries else 0)
                session = txn.open()
                key = self._key(pos)
                extent = session.locate(key)
                if extent is None:
                    self._budget.release(self, carry)
                    carry = 0
                    self._publish(pos, _Slot(ready=True))
                    continue
                need = extent.read_bytes or extent.length
                if carry >= need:
                    self._budget.release(self, carry - need)
                else:
                    self._reserve(need - carry, txn, batch)
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
                slot = _Slot(held=need)
                try:
                    extra = _decoded_bytes(data)
                    if extra:
                        self._reserve(extra, txn, batch)
                        slot.held += extra
                except BaseException:
                    self._budget.release(self, slot.held)
                    raise
                self._publish(pos, slot)
                batch.add(pos, slot, key, data)
                txn.tick()
            batch.flush()
        finally:
            self.schedule.counters.add(read_bytes=unflushed)
            if not self._stopping:  # a failure: what was read is still served before the error
                try:
                    batch.flush()
                except _Stop:
                    pass
            batch.drop()
            txn.close()
            self._budget.release(self, carry)
            if prober is not None:
                prober.close()

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
            self.read = pos + 1
            if slot.ready:
                self._advance()

    def _advance(self) -> None:
        """Move ``ready`` past every ready slot; wake the consumer. Caller holds ``_cond``."""
        moved = False
        # A slot can be gone for a moment: a failing decode task drops its entries before _fail moves _end.
        while self.ready < min(self.read, self._end) and (slot := self._slots.get(self.ready)) is not None and slot.ready:
            self._ready_bytes += slot.nbytes
            self.ready += 1
            moved = True
        # Wake the consumer only when what it waits for is there (a wake-up per entry cost more CPU
        # than the entries' decoding); state changes and the end of reading wake it in _set_state.
        if moved and (self._consumer_waits == "any" or self._consumer_waits == "fill" and self._frame_filled()):
            self._cond.notify_all()

    def _frame_filled(self) -> bool:
        """A frame's worth is ready. Caller holds ``_cond``."""
        return self._ready_bytes >= self._fill_bytes or self.ready - self.served >= _FILL_ENTRIES

    # ---- decode pool -----------------------------------------------------

    def _finish_all(self, items: list) -> None:
        """Verify and decompress a few read entries (a pool thread), then publish them under one lock."""
        decoded, failure = [], None
        for n, (pos, slot, key, data) in enumerate(items):
            try:
                parts = to_raw_entry(data)
            except InvalidRequest as exc:
                parts = ()
                slot.corrupt = True
                self._discard_corrupt(pos, key, exc)
            except BaseException as exc:
                failure = n, exc
                break
            decoded.append((pos, slot, parts))
        excess, published = 0, False
        with self._cond:
            for pos, slot, parts in decoded:
                if self.state is ReaderState.CANCELLED or pos >= self._end:
                    self._slots.pop(pos, None)
                    excess += slot.held
                else:
                    nbytes = sum(len(p) for p in parts)
                    excess += slot.held - nbytes
                    slot.parts, slot.nbytes, slot.held, slot.ready = parts, nbytes, nbytes, True
                    published = True
            if published:
                self._advance()
            if failure is not None:  # this entry and the rest of the batch are never served
                for pos, slot, _, _ in items[failure[0]:]:
                    self._slots.pop(pos, None)
                    excess += slot.held
        self._budget.release(self, excess)
        if failure is not None:
            self._fail(failure[1], at=items[failure[0]][0])

    def _discard_corrupt(self, pos: int, key: bytes, exc: InvalidRequest) -> None:
        log.warning("schedule %r position %d: stored entry is corrupt (%s); serving a miss and deleting it",
                    self.schedule.schedule_id, pos, exc)
        try:
            self._store.discard_corrupt([key])
        except ActCacheError as delete_error:
            log.warning("could not delete the corrupt entry: %s", delete_error)

    # ---- the consumer ----------------------------------------------------

    def frames(self, max_frame_bytes: int) -> Iterator[bytes]:
        """Fetch frames (entries in the payload) from ``start`` to the end; see ``batches``."""
        for batch in self.batches(max_frame_bytes):
            frame = encode_frame(batch.header.SerializeToString(), [p for parts in batch.entries for p in parts])
            batch.finish()
            yield frame

    def batches(self, max_frame_bytes: int) -> Iterator["ServedBatch"]:
        """The entries of one frame at a time, from ``start`` to the end.

        The consumer copies the entries out, then calls ``finish()`` (which
        releases their budget bytes and counts them; closing the generator
        does it too). Raises the reader's error after the entries read before
        it failed; returns early, quietly, if cancelled without an error for
        the consumer.
        """
        schedule = self.schedule
        self._fill_bytes = min(max_frame_bytes, _FILL_BYTES)
        while True:
            with self._cond:
                def over() -> bool:  # nothing more will become ready for this consumer
                    return (self.state is ReaderState.CANCELLED or self.served >= self._end
                            or self.state is ReaderState.FAILED and self.served not in self._slots)

                def filled() -> bool:  # a frame's worth is ready, or no more is coming soon
                    return (self._frame_filled() or over()
                            or self.state is not ReaderState.READING and self.ready >= min(self.read, self._end))

                stalled, waited = False, 0.0
                if self.served == self.ready and not over():
                    stalled, t0 = True, time.monotonic()
                    self._consumer_waits = "any"
                    self._cond.wait_for(lambda: self.served < self.ready or over())
                    waited = time.monotonic() - t0
                if not filled():
                    # Less than a frame is ready: rather than a small frame (costly on both sides),
                    # give the reader a moment to fill a reasonable one.
                    self._consumer_waits = "fill"
                    self._cond.wait_for(filled, _LINGER_S)
                self._consumer_waits = None
                if self.served == self.ready:
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
                if self._reader_waits:
                    self._cond.notify_all()
            stop = start + len(taken)
            header = pb.EntriesHeader(
                start=start,
                sample_ids=schedule.sample_ids[start:stop].tolist(),
                variants=schedule.variants[start:stop].tolist() if schedule.variants is not None else [],
                lengths=[s.nbytes for s in taken],
            )
            hits = sum(1 for s in taken if s.parts)
            counts = dict(
                hits=hits, misses=len(taken) - hits, corrupt=sum(s.corrupt for s in taken),
                ready_on_ask=len(taken) - stalled, stalls=int(stalled), stall_seconds=waited, served_bytes=size,
            )
            batch = ServedBatch(header, [s.parts for s in taken], size, self, sum(s.held for s in taken), counts)
            try:
                yield batch
            finally:
                batch.finish()
        self._on_change(self)


class ServedBatch:
    """One frame's entries taken from a reader: ``entries[i]`` is the parts of entry i ([] = a miss)."""

    __slots__ = ("header", "entries", "nbytes", "_reader", "_held", "_counts")

    def __init__(self, header: pb.EntriesHeader, entries: list, nbytes: int, reader: ScheduleReader,
                 held: int, counts: dict) -> None:
        self.header, self.entries, self.nbytes = header, entries, nbytes
        self._reader, self._held, self._counts = reader, held, counts

    def finish(self) -> None:
        """Release the entries' budget bytes and count them as served (once)."""
        if self._counts is None:
            return
        counts, self._counts = self._counts, None
        self._reader._budget.release(self._reader, self._held)
        self._reader.schedule.counters.add(**counts)


class _DecodeBatch:
    """Entries read but not yet handed to the decode pool: one pool task per few entries, not per entry.

    Handed over when it holds ``_BATCH_ENTRIES`` entries or ``_BATCH_BYTES``
    bytes, when the consumer has nothing ready, and before the reader waits.
    """

    def __init__(self, reader: ScheduleReader) -> None:
        self._reader = reader
        self._items: list = []
        self._bytes = 0

    def add(self, pos: int, slot: _Slot, key: bytes, data) -> None:
        self._items.append((pos, slot, key, data))
        self._bytes += len(data)
        r = self._reader
        if len(self._items) >= _BATCH_ENTRIES or self._bytes >= _BATCH_BYTES or r.ready == r.served:
            self.flush()

    def flush(self) -> None:
        if not self._items:
            return
        items, self._items, self._bytes = self._items, [], 0
        try:
            self._reader._decode.submit(self._reader._finish_all, items)
        except RuntimeError:  # the pool is shut down: the daemon is stopping
            self._items = items
            raise _Stop from None

    def drop(self) -> None:
        """Free what was never handed over (the reader is stopping)."""
        r = self._reader
        for pos, slot, _, _ in self._items:
            with r._cond:
                r._slots.pop(pos, None)
            r._budget.release(r, slot.held)
        self._items = []


def _decoded_bytes(data) -> int:
    """Extra bytes decoding ``data`` will allocate (0 for raw or malformed entries: served as they are)."""
    try:
        return decoded_size(data) if data[5] == Codec.zstd else 0
    except (InvalidRequest, IndexError):
        return 0
