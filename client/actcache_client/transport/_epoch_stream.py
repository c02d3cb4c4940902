"""The epoch's cached entries, streamed by the daemon in the order the step will ask for them.

The loader hands over this rank's batches for the epoch; the stream pushes their ids (the cached subset of
each batch, at the cache target) as one schedule, which the daemon reads ahead, and reads them back with Fetch
(shared memory on a Unix socket of this host, else bytes). ``take`` returns one batch's entries (None per
miss) as views the caller copies once (collation) before the next ``take``; with ``columns``, a batch whose
tensors lie in the ring as columns (``columns``) may be used where it lies while the caller holds it
(``ClientSegment.hold``). Schedule ids are
``<job>-r<rank>-<slot>``; the two slots alternate between epochs, so pushing epoch e+1 ahead (halfway through
epoch e, in a thread: ``_Ahead``) leaves epoch e streaming.

Lifecycle: idle (nothing pushed, or the target is not cached) -> serving (schedule pushed, Fetch opened at the
first ``take``) -> broken (the push or the Fetch failed, or the step asked out of order): idle or broken, every
``take`` answers None until the next push, and the caller falls back to Get.

Invariants: entries are consumed in schedule order; batch b's entries are the schedule positions from
``offsets[b]`` to ``offsets[b+1] - 1``. Only the ``_Ahead`` thread advances its Fetch until the training thread
has joined it (``result``); a cancelled ``_Ahead`` closes its Fetch in its own thread.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Callable, Generator, Sequence

from actcache.entries import ColumnEntry, ColumnRun, EntryBatch
from actcache.errors import ActCacheError
from actcache.shm import SlotRun
from actcache_client.cost_model import cached_subset
from actcache_client.transport._connection import Connection

if TYPE_CHECKING:
    from actcache_client.transport._device_staging import Completion

__all__ = ["EpochStream", "Target"]

_JOB = f"{socket.gethostname()[:40]}.{os.getpid()}"
_JOBS = itertools.count()


# A Fetch's shared-memory ring holds _RING_BATCHES batches, within these bounds (a ring's first use and
# unmapping cost time in proportion to its size); _FIRST_RING until a frame has shown the entries' size.
_MIN_RING, _MAX_RING, _RING_BATCHES, _FIRST_RING = 4 << 20, 64 << 20, 4, 16 << 20


def _sizes(values: Sequence, batch_entries: int) -> tuple[int, int] | None:
    """``(ring bytes, frame bytes)`` for the next Fetch from a frame's entries (None per miss; None if
    all are): frames of one batch, so the step never waits for more than its own batch, and a ring of
    whole frames, so a batch of entries of one size is always one run of slots (one copy)."""
    entry = max((len(v) for v in values if v is not None), default=0)
    if not entry:
        return None
    batch = batch_entries * entry
    if batch > _MAX_RING:
        return _MAX_RING, batch
    frames = min(max(_RING_BATCHES, -(-_MIN_RING // batch)), _MAX_RING // batch)
    return frames * batch, batch  # whole frames: none straddles the ring's end


class _Hold:
    """Keeps a batch's entries in the ring while alive (``ClientSegment.hold``)."""


@dataclass(frozen=True)
class Target:
    """Where the cache serves the frozen prefix from: entries under ``fingerprint`` at ``depth``, for the
    ``fraction`` of samples in the cached subset."""

    fingerprint: bytes
    depth: int
    fraction: float


def cached_batches(batches: Sequence[Sequence[int]], fraction: float) -> tuple[tuple[int, ...], ...]:
    """Each batch's sample ids in the cached subset (all of them at fraction 1)."""
    if fraction >= 1.0:
        return tuple(map(tuple, batches))
    return tuple(tuple(s for s in b if cached_subset(s, fraction)) for b in batches)


class _Ahead:
    """The next epoch's order pushed and its Fetch opened in a thread, so the daemon decodes its head
    while the current epoch runs. Errors (strict mode) reach the training thread through ``pushed``/``result``."""

    def __init__(self, push: Callable[[], list[bool] | None], open_: Callable[[], Generator[EntryBatch, None, None]]) -> None:
        self._lock = threading.Lock()
        self._pushed = threading.Event()
        self._present: list[bool] | None = None
        self._frames: Generator[EntryBatch, None, None] | None = None
        self._first: EntryBatch | None = None
        self._error: BaseException | None = None
        self._done = self._abandoned = False
        self._thread = threading.Thread(target=self._run, args=(push, open_), name="actcache-stream-ahead", daemon=True)
        self._thread.start()

    def _run(self, push: Callable[[], list[bool] | None], open_: Callable[[], Generator[EntryBatch, None, None]]) -> None:
        try:
            self._present = push()
            self._pushed.set()
            if self._present is not None and not self._abandoned:
                self._frames = open_()
                self._first = next(self._frames, None)
        except BaseException as exc:  # handed to the training thread
            self._error = exc
        finally:
            self._pushed.set()
            with self._lock:
                self._done = True
            if self._abandoned and self._frames is not None:  # close() left it to this thread
                self._frames.close()

    def pushed(self) -> list[bool] | None:
        """Which entries of the order are stored (the push's reply), or None if the push failed."""
        self._pushed.wait()
        if self._error is not None and self._present is None:
            raise self._error
        return self._present

    def result(self) -> tuple[Generator[EntryBatch, None, None] | None, EntryBatch | None]:
        """The frames and the first one (None: the stream ended), once it has come."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._frames, self._first

    def close(self) -> None:
        """Cancel: now if the thread is done, else as soon as it is (in the thread)."""
        with self._lock:
            self._abandoned = not self._done
        if self._done and self._frames is not None:
            self._frames.close()


@dataclass(frozen=True)
class _Order:
    """One epoch's batches at one target, from batch ``first`` on."""

    target: Target
    variant: int
    first: int  # epoch position of batches[0]
    batches: tuple[tuple[int, ...], ...]  # the cached subset of each batch
    offsets: tuple[int, ...]  # schedule position of each batch's first entry, plus the end
    present: list[bool]  # per schedule position: the entry was stored when the order was pushed

    @classmethod
    def of(cls, target: Target, variant: int, batches: Sequence[Sequence[int]], first: int = 0) -> "_Order":
        subset = cached_batches(batches, target.fraction)
        offsets = (0, *itertools.accumulate(len(b) for b in subset))
        return cls(target, variant, first, subset, offsets, [])

    def push(self, connection: Connection, schedule_id: str) -> list[bool] | None:
        ids = [s for b in self.batches for s in b]
        variants = [self.variant] * len(ids) if self.variant else None
        return connection.push(self.target.fingerprint, self.target.depth, schedule_id, ids, variants)

    def absent(self, b: int) -> bool:
        """Whether the push said that no entry of ``batches[b]`` was stored (a write epoch)."""
        return len(self.present) == self.offsets[-1] and not any(self.present[self.offsets[b]:self.offsets[b + 1]])

    def at(self, position: int, *, end: bool = False) -> int | None:
        """The index in ``batches`` of epoch batch ``position`` (with ``end``, the end too), or None."""
        b = position - self.first
        return b if 0 <= b < len(self.batches) + end else None


class EpochStream:
    """Pushes an epoch's order and streams its entries back; used by CachedForward on the training thread."""

    def __init__(self, connection: Connection, *, rank: int = 0, columns: bool = False) -> None:
        """``columns``: ask for frames of columns (the caller uses batches where they lie in the ring)."""
        self._connection = connection
        self._columns = columns
        self._prefix = f"{_JOB}.{next(_JOBS)}-r{rank}"
        self._ring_bytes = _FIRST_RING
        self._frame_bytes = 0  # the daemon's default until a frame shows the entries' size
        self._ahead: tuple[_Order, _Ahead] | None = None  # the next epoch's order, pushed and its Fetch opened ahead
        self._ahead_resumes = 0  # the connection's ``resumes`` when it was pushed
        self._opened: _Ahead | None = None  # the current order's Fetch, opened ahead and not read yet
        self._slot = 0
        self._serving = False  # an order is pushed and its stream not broken
        self._order: _Order | None = None
        self._frames: Generator[EntryBatch, None, None] | None = None
        self._pending: deque = deque()  # entries of the last frame not taken yet
        self._shared = False  # the last frame's values are views into the shared-memory ring
        #: Where the last ``take``'s entries lie, if hits of one size in consecutive ring slots (EntryBatch.run).
        self.run: SlotRun | None = None
        self._frame_run: tuple[int, SlotRun | None] = (0, None)  # (first position, run) of the last frame
        #: Where the last ``take``'s entries lie, if hits written as columns (EntryBatch.columns).
        self.columns: ColumnRun | None = None
        self._frame_columns: ColumnRun | None = None  # the last frame's
        self._held: Completion | None = None  # the last batch's slots are read until it completes
        self._split: _Hold | None = None  # keeps the columns of the last take's entries from an earlier frame

    @property
    def schedule_id(self) -> str:
        return f"{self._prefix}-{self._slot}"

    def push(self, target: Target, variant: int, batches: Sequence[Sequence[int]], first: int) -> None:
        """Push ``batches`` (epoch positions ``first``, ``first + 1``, ...) at this target, replacing the stream."""
        self.close()  # IDLE
        self.discard_next()
        self._slot ^= 1
        self._order = _Order.of(target, variant, batches, first)
        if self._order.offsets[-1]:
            present = self._order.push(self._connection, self.schedule_id)
            self._order = replace(self._order, present=present or [])
            self._serving = present is not None

    def push_next(self, target: Target, variant: int, batches: Sequence[Sequence[int]]) -> None:
        """Push the next epoch's order into the other slot and open its Fetch in a thread (``adopt_next``)."""
        order = _Order.of(target, variant, batches)
        if not order.offsets[-1]:
            return
        self.discard_next()
        schedule_id = f"{self._prefix}-{self._slot ^ 1}"
        self._ahead_resumes = self._connection.resumes  # a daemon that came back since has not got this order
        self._ahead = order, _Ahead(partial(order.push, self._connection, schedule_id),
                                    partial(self._connection.stream, schedule_id, 0, ring_bytes=self._ring_bytes,
                                            max_frame_bytes=self._frame_bytes, ahead=True, columns=self._columns))

    def adopt_next(self, target: Target, variant: int, batches: Sequence[Sequence[int]]) -> bool:
        """Switch to the order ``push_next`` pushed, if it is this one; False (nothing changed) otherwise."""
        if self._ahead is None:
            return False
        (o, ahead), self._ahead = self._ahead, None
        same = ((o.target, o.variant, o.batches) == (target, variant, cached_batches(batches, target.fraction))
                and self._ahead_resumes == self._connection.resumes)
        present = ahead.pushed() if same else None
        if present is None:
            ahead.close()
            return False
        self.close()
        self._slot ^= 1
        self._order, self._serving, self._opened = replace(o, present=present), True, ahead
        return True

    def discard_next(self) -> None:
        """Forget the order ``push_next`` pushed (read ahead before this epoch's misses were stored)."""
        if self._ahead is not None:
            self._ahead[1].close()
            self._ahead = None

    def serves(self, target: Target, variant: int) -> bool:
        """Whether the pushed order is for this target (a re-plan that keeps it keeps the stream)."""
        return self._order is not None and (self._order.target, self._order.variant) == (target, variant)

    def stored_from(self, position: int) -> list[bool] | None:
        """Per entry of the pushed order from epoch batch ``position`` on: whether it was stored when the
        order was pushed (the push's reply). None if no order covers ``position``."""
        o = self._order
        b = o.at(position, end=True) if self._serving and o is not None else None
        return None if o is None or b is None else o.present[o.offsets[b]:]

    def take_absent(self, position: int, ids: Sequence[int]) -> bool:
        """Take epoch batch ``position`` (the cached subset ``ids``) if the pushed order says that none of its
        entries was stored when it was pushed (a write epoch): no frame is read, its samples are counted as
        absent. False (nothing taken) otherwise."""
        o = self._order
        b = o.at(position) if self._serving and o is not None else None
        if o is None or b is None or tuple(ids) != o.batches[b] or not o.absent(b):
            return False
        self._connection.count_absent(len(ids))
        return True

    def take(self, position: int, ids: Sequence[int]) -> list | None:
        """Entries (None per miss) of the cached subset ``ids`` of epoch batch ``position``; None if the
        stream cannot serve it (nothing pushed, failed, another order)."""
        o = self._order
        b = o.at(position) if self._serving and o is not None else None
        if o is None or b is None:
            return None
        if tuple(ids) != o.batches[b]:
            self.close()  # broken: no take is served until the next push
            return None
        lo, hi = o.offsets[b], o.offsets[b + 1]
        if o.absent(b):
            self._connection.count_absent(hi - lo)  # none was stored when pushed (a write epoch): no frame to read
            return [None] * (hi - lo)
        out: list = []
        self.run, self.columns, self._split, split = None, None, None, False  # split: the entries span frames
        try:
            while len(out) < hi - lo:
                if not self._pending:
                    split = bool(out)
                    self._next_frame(out, lo)
                pos, sample_id, variant, value = self._pending.popleft()
                if pos < lo:
                    continue  # a batch the step skipped
                if sample_id != ids[len(out)]:
                    raise ActCacheError(f"the stream served sample {sample_id} at position {pos}, expected {ids[len(out)]}")
                out.append(value)
        except ActCacheError as exc:
            self.close()
            self._connection.fallback(exc)
            return None
        frame_start, run = self._frame_run
        if run is not None and not split:  # all from one frame whose entries are one run
            self.run = run.skip(lo - frame_start)
        columns = self._frame_columns
        if columns is not None and not split and all(v is not None for v in out):
            self.columns = columns.sub(lo - columns.position, hi - lo)
        return out

    def hold(self, event: Completion) -> None:
        """Keep the last ``take``'s slots until ``event`` (an asynchronous copy reading them) completes."""
        self._held = event

    def _wait_held(self) -> None:
        if self._held is not None:
            self._held.synchronize()
            self._held = None

    def _next_frame(self, out: list, lo: int) -> None:
        """Read the next frame; views into the ring held in ``out`` are copied first (the ring reuses them)."""
        self._wait_held()  # asking for the next frame releases the last one's slots
        if self._shared:  # entries in columns stay there (held until the next take), others are copied
            out[:] = [v if v is None or isinstance(v, ColumnEntry) else bytes(v) for v in out]
            kept = next((v for v in out if isinstance(v, ColumnEntry)), None)
            if kept is not None and self._split is None:
                self._split = _Hold()
                kept.run.segment.hold(kept.run.position + kept.index, self._split)
        opened = self._frames is None
        if opened and self._opened is not None:  # opened ahead (from position 0)
            opening, self._opened = self._opened, None
            t0 = time.perf_counter()
            self._frames, batch = opening.result()
            if batch is not None:
                self._connection.count_streamed(batch, time.perf_counter() - t0)
        else:
            if self._frames is None:  # opened
                self._frames = self._connection.stream(self.schedule_id, lo, ring_bytes=self._ring_bytes,
                                                       max_frame_bytes=self._frame_bytes, columns=self._columns)
            batch = next(self._frames, None)
        if batch is None:
            raise ActCacheError(f"schedule {self.schedule_id} ended before position {lo + len(out)}")
        self._shared = batch.data_plane == "shared_memory"
        self._pending.extend(batch)
        self._frame_run = (batch.start, batch.run)
        self._frame_columns = batch.columns
        sizes = _sizes(batch.values, max(map(len, self._order.batches))) if opened and self._order is not None else None
        if sizes is not None:
            self._ring_bytes, self._frame_bytes = sizes

    def close(self) -> None:
        """Cancel the Fetch (the daemon frees its read-ahead for it at once); no take is served until the next push."""
        self._wait_held()  # the ring goes back to the pool, for another stream to write
        for fetch in (self._frames, self._opened):
            if fetch is not None:
                fetch.close()
        self._frames = self._opened = None
        self._pending.clear()
        self._frame_run, self.run, self._shared = (0, None), None, False
        self._frame_columns = self.columns = self._split = None
        self._serving = False
