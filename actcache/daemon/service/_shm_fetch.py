"""Fetch over shared memory: the ring a stream's entries are decoded into, and its frames of slot descriptors."""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

from actcache._proto import actcache_pb2 as pb
from actcache.served import copy_raw_run, served_size, stored_raw
from actcache.daemon.prefetch import DirectRun
from actcache.rpc import encode_frame
from actcache.shm import ShmRing, reusable

if TYPE_CHECKING:
    from actcache.daemon.service._throttle import Throttle

__all__ = ["ParkedRings", "fetch_shm", "ring_for"]

# Positions a direct run covers at most; a frame looks up a frame's worth of them.
_DIRECT_ENTRIES = 1024
# How long a frame waits for room for all of it (ShmRing.wait_frame_room): longer than a training
# step between two frames; a client holding several frames on purpose gets what fits after it.
_WHOLE_FRAME_PATIENCE_S = 0.5


class ParkedRings:
    """Rings whose client mapped them, kept for that client's next Fetch (``FetchRequest.reuse_segment``).

    Thread-safe. A ring waits at most ``idle_s``, and at most ``max_bytes`` of rings wait (oldest go first).
    """

    def __init__(self, *, idle_s: float = 30.0, max_bytes: int = 256 << 20) -> None:
        self.idle_s, self.max_bytes = idle_s, max_bytes
        self._rings: dict[str, tuple[ShmRing, float]] = {}  # by segment path, oldest first
        self._cond = threading.Condition()
        self._closed = False
        self._janitor: threading.Thread | None = None

    def park(self, ring: ShmRing) -> None:
        with self._cond:
            if self._closed:
                dropped = [ring]
            else:
                self._rings[str(ring.path)] = (ring, time.monotonic())
                dropped = self._drop(lambda _: sum(r.capacity for r, _ in self._rings.values()) > self.max_bytes)
                if self._janitor is None:
                    self._janitor = threading.Thread(target=self._expire, name="actcache-rings", daemon=True)
                    self._janitor.start()
        for old in dropped:
            old.close()

    def take(self, path: str, ring_bytes: int) -> ShmRing | None:
        """The parked ring named ``path``, unparked, if it serves a ring of ``ring_bytes``; else None."""
        with self._cond:
            ring, _ = self._rings.get(path, (None, 0.0))
            if ring is None or not reusable(ring.capacity, ring_bytes):
                return None
            del self._rings[path]
            return ring

    def __len__(self) -> int:
        with self._cond:
            return len(self._rings)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            dropped = self._drop(lambda _: True)
            self._cond.notify_all()
        for ring in dropped:
            ring.close()

    def _drop(self, while_: Callable[[float], bool]) -> list[ShmRing]:
        """Unpark the oldest rings while ``while_(their parking time)`` (the lock is held)."""
        dropped = []
        while self._rings and while_(next(iter(self._rings.values()))[1]):
            dropped.append(self._rings.pop(next(iter(self._rings)))[0])
        return dropped

    def _expire(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(self.idle_s / 4)
                dropped = self._drop(lambda parked: parked < time.monotonic() - self.idle_s)
            for ring in dropped:
                ring.close()


def ring_for(request: pb.FetchRequest, context, parked: ParkedRings) -> tuple["ShmRing | None", str, bool]:
    """A shared-memory ring for this Fetch and whether it is the parked one the request names; or None
    and why the bytes path is taken."""
    if not request.shared_memory:
        return None, "not asked for", False
    if not context.peer().startswith("unix:"):
        return None, f"client is not on this host's Unix socket ({context.peer()})", False
    ring_bytes = ShmRing.size_for(request.ring_bytes)
    ring = parked.take(request.reuse_segment, ring_bytes) if request.reuse_segment else None
    if ring is not None:
        ring.restart(request.start, ring_bytes)
        return ring, "", True
    try:
        return ShmRing(request.ring_bytes, request.start), "", False
    except OSError as exc:
        return None, f"shared memory unavailable: {exc}", False


def fetch_shm(reader, ring: "ShmRing", frame_bytes: int, context, throttle: "Throttle | None", *,
              whole_frames: bool = False) -> Iterator[bytes]:
    """Frames of slot descriptors: each entry is decoded into its slot once the slot is free.

    A frame waits a while (``whole_frames``: indefinitely) for room for all of it, then sends what
    fits (actcache.shm, Invariants). An entry larger than the ring travels in its frame's payload.
    A warm stream is read here straight into the slots (``DirectRun``), a frame's worth per LMDB call.
    """
    first = True

    def frame(header: pb.EntriesHeader, lo: int, hi: int, offsets: list[int], inline: tuple = ()) -> bytes:
        nonlocal first
        out = pb.EntriesHeader(
            start=header.start + lo, sample_ids=header.sample_ids[lo:hi],
            variants=header.variants[lo:hi] if header.variants else [], lengths=header.lengths[lo:hi],
            offsets=offsets,
        )
        if first:
            out.data_plane, out.segment, first = "shared_memory", str(ring.path), False
        return encode_frame(out.SerializeToString(), list(inline))

    patience_s = math.inf if whole_frames else _WHOLE_FRAME_PATIENCE_S
    entry_bytes = 0  # the largest entry seen: how many positions a direct run looks up for a frame
    for batch in reader.batches(frame_bytes, direct_entries=_DIRECT_ENTRIES):
        if isinstance(batch, DirectRun):
            entry_bytes = entry_bytes or batch.entry_size()
            count = _frame_entries(batch.start, frame_bytes, entry_bytes)
            if entry_bytes and not ring.wait_frame_room(count * entry_bytes, entry_bytes, context.is_active,
                                                        patience_s, uniform=True):
                return
            served = _copy_direct(batch, ring, count, frame_bytes)
            if served is None:
                continue
            lengths, offsets, blocked = served
            entry_bytes = max([entry_bytes, *lengths])
            if lengths:
                yield frame(batch.header(lengths), 0, len(lengths), offsets)
                if throttle is not None:
                    throttle.consume(sum(lengths))
            if blocked and not ring.wait_room(blocked, context.is_active):
                return
            continue
        header, count, lo = batch.header, len(batch.stored), 0
        ring.poll()
        if count and not ring.wait_frame_room(sum(header.lengths), max(header.lengths), context.is_active,
                                             patience_s):
            return
        if not count:
            yield frame(header, 0, 0, [])
        while lo < count:
            hi, offsets = _alloc_run(ring, header, lo, count, context)
            if hi is None:
                return
            if hi == lo:  # larger than the ring: in the payload
                yield frame(header, lo, lo + 1, [0], batch.decode_one(lo))
                lo += 1
                continue
            sizes = header.lengths[lo:hi]
            batch.decode_into(range(lo, hi), [ring.view(o, n) if n else None for o, n in zip(offsets, sizes)])
            yield frame(header, lo, hi, [o if n else 0 for o, n in zip(offsets, header.lengths[lo:hi])])
            lo = hi
        batch.finish()
        if throttle is not None:
            throttle.consume(batch.nbytes)


def _frame_entries(position: int, frame_bytes: int, entry_bytes: int) -> int:
    """Positions a direct run from ``position`` looks up for one frame: up to the next multiple of a
    frame's entries, so frames align again after a short one."""
    if not entry_bytes:
        return _DIRECT_ENTRIES
    per_frame = max(1, frame_bytes // entry_bytes)
    return per_frame - position % per_frame


def _copy_direct(run: DirectRun, ring: ShmRing, count: int, frame_bytes: int) -> tuple[list[int], list[int], int] | None:
    """Copy up to ``count`` entries of ``run`` (``frame_bytes`` at most, one at least) into ring slots in
    one read transaction: ``(lengths, offsets)`` of the prefix served (0 for a miss) and the size of the
    first entry that did not fit now (0: none); None if the run was given back to the regular path
    (cold values, or an entry larger than the ring)."""
    ring.poll()
    with run.values(count) as views:
        if views is None:
            run.give_back()
            return None
        served = (_copy_uniform(run.start, views, ring, frame_bytes)
                  or _copy_each(run.start, views, ring, frame_bytes, run.decode_into))
    lengths, offsets, errors, blocked = served
    if not lengths and not blocked:  # the first entry is larger than the ring
        run.give_back()
        return None
    corrupt = [(i, exc) for i, exc in enumerate(errors) if exc is not None]
    for i, _ in corrupt:
        lengths[i] = offsets[i] = 0
    run.done(lengths, corrupt)
    return lengths, offsets, blocked


def _copy_each(position: int, views: list, ring: ShmRing, frame_bytes: int,
               decode_into: Callable[[list, list[memoryview]], list]) -> tuple[list[int], list[int], list, int]:
    """``_copy_direct`` entry by entry, into what fits the ring now: ``(lengths, offsets, errors, blocked)``,
    one error (or None) per position served."""
    lengths: list[int] = []
    offsets: list[int] = []
    blocked = total = 0
    for i, view in enumerate(views):
        size = 0 if view is None else served_size(view)
        total += size
        if size > ring.ring_bytes or total > frame_bytes and total > size:
            break
        offset = ring.alloc(position + i, size) if size else 0
        if offset is None:
            blocked = size
            break
        lengths.append(size)
        offsets.append(offset)
    todo = [i for i, n in enumerate(lengths) if n]
    decoded = decode_into([views[i] for i in todo], [ring.view(offsets[i], lengths[i]) for i in todo])
    errors: list = [None] * len(lengths)
    for i, exc in zip(todo, decoded):
        errors[i] = exc
    return lengths, offsets, errors, blocked


def _copy_uniform(position: int, views: list, ring: ShmRing, frame_bytes: int
                  ) -> tuple[list[int], list[int], list, int] | None:
    """``_copy_direct``'s usual case in one pass: raw entries of one size, a frame's worth fitting the ring
    now, copied and verified into consecutive slots: ``_copy_each``'s result; else None (nothing allocated)."""
    size = len(views[0]) if views and views[0] is not None else 0
    if not size:
        return None
    count = min(len(views), max(1, frame_bytes // size))
    head = views[:count]
    if count * size > ring.ring_bytes or any(v is None or len(v) != size or not stored_raw(v) for v in head):
        return None
    blocks = ring.alloc_run(position, count, size)
    if blocks is None:
        return None
    offsets: list[int] = []
    errors: list = []
    for offset, n in blocks:
        offsets += range(offset, offset + n * size, size)
        errors += copy_raw_run(head[len(errors) : len(errors) + n], ring.view(offset, n * size))
    return [size] * count, offsets, errors, 0


def _alloc_run(ring: "ShmRing", header: pb.EntriesHeader, lo: int, count: int, context) -> tuple[int | None, list[int]]:
    """Slots for entries ``lo..hi`` (misses: offset 0), as many as fit now, waiting only for the first:
    ``(hi, offsets)``; ``hi == lo`` when entry ``lo`` is larger than the ring, None if the call ended."""
    offsets: list[int] = []
    hi = lo
    while hi < count:
        size = header.lengths[hi]
        if not size:
            offsets.append(0)
        elif size > ring.ring_bytes:
            break
        else:
            offset = ring.alloc(header.start + hi, size)
            if offset is None:
                if hi > lo:
                    break
                offset = ring.wait_alloc(header.start + hi, size, context.is_active)
                if offset is None:
                    return None, offsets
            offsets.append(offset)
        hi += 1
    return hi, offsets
