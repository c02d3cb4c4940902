"""Fetch over shared memory: the ring a stream's entries are decoded into, and its frames of slot descriptors;
the read throttle of both data planes."""

from __future__ import annotations

import functools
import math
import threading
import time
from typing import Callable, Generator, Iterator, Sequence

from actcache._proto import actcache_pb2 as pb
from actcache.codec import Codec, EntryHeader
from actcache.daemon.prefetch import DirectRun
from actcache.errors import ConfigError
from actcache.rpc import encode_frame
from actcache.served import copy_raw_columns, copy_raw_run, served_size, stored_raw, uniform_layout
from actcache.shm import COLUMN_ALIGN, ShmRing, column_starts, reusable

__all__ = ["ParkedRings", "Throttle", "fetch_shm", "serve_fetch"]

# Positions a direct run covers at most; a frame looks up a frame's worth of them.
_DIRECT_ENTRIES = 1024
# How long a frame waits for room for all of it (ShmRing.wait_frame_room): longer than a training
# step between two frames; a client holding several frames on purpose gets what fits after it.
_WHOLE_FRAME_PATIENCE_S = 0.5


class Throttle:
    """Read throttle (``--throttle-read-mbps``) reproducing a slow disk: a token bucket of ``rate`` bytes/s
    with a burst of ``burst_s`` seconds of traffic (after an idle spell ``n`` bytes wait ``n / rate - burst_s``)."""

    def __init__(self, bytes_per_s: float, *, burst_s: float = 0.05) -> None:
        if bytes_per_s <= 0:
            raise ConfigError(f"throttle rate must be > 0 bytes/s, got {bytes_per_s}; pass --throttle-read-mbps > 0")
        self.rate = float(bytes_per_s)
        self._burst = self.rate * burst_s
        self._lock = threading.Lock()
        self._ready_at = time.monotonic()  # when the bucket has paid for all reservations so far

    def consume(self, nbytes: int) -> float:
        """Block until ``nbytes`` may be sent; returns the seconds waited."""
        with self._lock:
            now = time.monotonic()
            # The bucket refills while idle but never holds more than the burst: the slack is
            # granted once, below, not also by backdating the start.
            self._ready_at = max(self._ready_at, now) + nbytes / self.rate
            wait = self._ready_at - now - self._burst / self.rate
        if wait > 0:
            time.sleep(wait)  # rate limiting: the wait is the point
            return wait
        return 0.0


class ParkedRings:
    """Rings whose client mapped them, kept for that client's next Fetch (``FetchRequest.reuse_segment``):
    each for at most ``idle_s``, at most ``max_bytes`` of them (oldest go first). Thread-safe."""

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


def serve_fetch(request: pb.FetchRequest, context, parked: ParkedRings, reader, frame_bytes: int,
                throttle: Throttle | None, count: Callable[..., None]) -> Generator[bytes, None, str | None]:
    """Serve a Fetch over a shared-memory ring (the parked one the request names, else a new one), parked
    again for its client once mapped. Returns None, or, having sent nothing, why the bytes path is taken."""
    if not request.shared_memory:
        return "not asked for"
    if not context.peer().startswith("unix:"):
        return f"client is not on this host's Unix socket ({context.peer()})"
    ring_bytes = ShmRing.size_for(request.ring_bytes)
    ring = parked.take(request.reuse_segment, ring_bytes) if request.reuse_segment else None
    if ring is not None:
        ring.restart(request.start, ring_bytes)
        count(rings_reused_total=1)
    else:
        try:
            ring = ShmRing(request.ring_bytes, request.start)
        except OSError as exc:
            return f"shared memory unavailable: {exc}"
        count(rings_created_total=1)
    context.add_callback(ring.unlink)  # a client gone before mapping leaves no name behind
    named = False
    try:
        for frame in fetch_shm(reader, ring, frame_bytes, context, throttle, whole_frames=request.whole_frames,
                               columns=request.columns):
            named = True
            yield frame
    finally:
        if named:  # the client has the segment's name: the stream ends (and the name goes) once it mapped
            ring.wait_mapped(context.is_active)
        if ring.client_mapped:  # nothing writes to it any more: its client's next Fetch may reuse it
            parked.park(ring)
        else:
            ring.close()
    return None


def fetch_shm(reader, ring: "ShmRing", frame_bytes: int, context, throttle: Throttle | None, *,
              whole_frames: bool = False, columns: bool = False) -> Iterator[bytes]:
    """Frames of slot descriptors, each entry decoded into its slot once free; a frame waits a while
    (``whole_frames``: indefinitely) for room for all of it, then sends what fits (actcache.shm, Invariants).
    An entry larger than the ring travels in the payload, and so do the entries the client waits for when
    the ring is full; warm runs (``DirectRun``) are read straight in. ``columns``: a frame of raw entries of
    one layout is written as columns when they fit without wrapping (``_write_columns``)."""
    first = True

    def frame(header: pb.EntriesHeader, lo: int, hi: int, offsets: list[int], inline: tuple | list = (),
              starts: list[int] | None = None) -> bytes:
        nonlocal first
        out = pb.EntriesHeader(
            start=header.start + lo, sample_ids=header.sample_ids[lo:hi],
            variants=header.variants[lo:hi] if header.variants else [], lengths=header.lengths[lo:hi],
            offsets=offsets, columns=starts or [],
        )
        if first:
            out.data_plane, out.segment, first = "shared_memory", str(ring.path), False
        return encode_frame(out.SerializeToString(), list(inline))

    patience_s = math.inf if whole_frames else _WHOLE_FRAME_PATIENCE_S
    entry_bytes = 0  # the largest entry seen: how many positions a direct run looks up for a frame
    for batch in reader.batches(frame_bytes, direct_entries=_DIRECT_ENTRIES):
        if isinstance(batch, DirectRun):
            entry_bytes = entry_bytes or batch.entry_size()
            if entry_bytes and ring.stalled(batch.start) and not ring.has_room(entry_bytes):
                batch.give_back()  # the regular path sends it in the payload
                continue
            # look up to the next multiple of a frame's entries: frames align again after a short one
            per_frame = max(1, frame_bytes // entry_bytes) if entry_bytes else 0
            count = per_frame - batch.start % per_frame if per_frame else _DIRECT_ENTRIES
            if entry_bytes and not ring.wait_frame_room(count * entry_bytes, entry_bytes, context.is_active,
                                                        patience_s, uniform=True, position=batch.start):
                return
            served = _copy_direct(batch, ring, count, frame_bytes, columns)
            if served is None:
                continue
            lengths, offsets, blocked, laid = served
            entry_bytes = max([entry_bytes, *lengths])
            if lengths:
                yield frame(batch.header(lengths), 0, len(lengths), offsets, *laid)
                if throttle is not None:
                    throttle.consume(sum(lengths))
            if blocked and not ring.wait_room(blocked, context.is_active, batch.start + len(lengths)):
                return
            continue
        header, count, lo = batch.header, len(batch.stored), 0
        ring.poll()
        if count and not ring.wait_frame_room(sum(header.lengths), max(header.lengths), context.is_active,
                                             patience_s, position=header.start):
            return
        if not count:
            yield frame(header, 0, 0, [])
        written = _write_columns(ring, header.start, batch.stored) if columns and count else None
        if written is not None:
            heads, starts, layout, views = written
            batch.copy_columns(layout, views)
            yield frame(header, 0, count, [], [heads], starts)
            lo = count
        while lo < count:
            hi, offsets = _alloc_run(ring, header, lo, count, context)
            if hi is None:
                return
            if hi == lo:  # larger than the ring, or the client waits for it with the ring full: in the payload
                stop = count if ring.stalled(header.start + lo) else lo + 1
                parts = batch.decode(range(lo, stop))
                yield frame(header, lo, stop, [0] * (stop - lo), [part for entry in parts for part in entry])
                lo = stop
                continue
            sizes = header.lengths[lo:hi]
            batch.decode_into(range(lo, hi), [ring.view(o, n) if n else None for o, n in zip(offsets, sizes)])
            yield frame(header, lo, hi, offsets)
            lo = hi
        batch.finish()
        if throttle is not None:
            throttle.consume(batch.nbytes)


_Laid = tuple  # ``(payload parts, column starts)`` of a frame of columns, () for slots


def _copy_direct(run: DirectRun, ring: ShmRing, count: int, frame_bytes: int,
                 columns: bool) -> tuple[list[int], list[int], int, _Laid] | None:
    """Copy up to ``count`` entries of ``run`` (``frame_bytes`` at most, one at least) into ring slots (or
    ``columns``) in one read transaction: ``(lengths, offsets, blocked, laid)`` of the prefix served (0 for a
    miss; ``blocked``: the size of the first entry that did not fit now; ``laid``: the frame's columns);
    None if the run went back to the regular path."""
    ring.poll()
    with run.values(count) as views:
        copied = None if views is None else _copy_views(run.start, views, ring, frame_bytes, run.decode_into,
                                                        run.split, columns)
    lengths, offsets, corrupt, blocked, laid = copied or ([], [], [], 0, ())
    if not lengths and not blocked:  # not read, or the first entry is larger than the ring
        run.give_back()
        return None
    for i, _ in corrupt:
        lengths[i] = 0
        if offsets:
            offsets[i] = 0
    run.done(lengths, corrupt)
    return lengths, offsets, blocked, laid


def _copy_views(position: int, views: list, ring: ShmRing, frame_bytes: int,
                decode_into: Callable[[list, list[memoryview]], list],
                split: Callable[[Sequence[int], Callable[[range], None]], None],
                columns: bool = False) -> tuple[list[int], list[int], list, int, _Laid]:
    """``_copy_direct``'s copy: ``(lengths, offsets, corrupt, blocked, laid)``, ``corrupt`` as ``DirectRun.done``
    takes it; raw entries of one size in one pass into columns or consecutive slots (``split`` over threads),
    else entry by entry."""
    size = len(views[0]) if views and views[0] is not None else 0
    count = min(len(views), max(1, frame_bytes // size)) if size else 0
    head = views[:count]
    uniform = size and count * size <= ring.ring_bytes and all(
        v is not None and len(v) == size and stored_raw(v) for v in head)
    written = _write_columns(ring, position, head) if uniform and columns else None
    if written is not None:
        heads, starts, layout, outs = written
        failed: list = [None] * count
        widths = [spec.nbytes for spec in layout.specs]

        def copy_columns(part: range) -> None:
            failed[part.start : part.stop] = copy_raw_columns(
                head[part.start : part.stop], layout,
                [out[part.start * n : part.stop * n] for out, n in zip(outs, widths)])

        split([size] * count, copy_columns)
        return [size] * count, [], [(i, exc) for i, exc in enumerate(failed) if exc is not None], 0, ([heads], starts)
    blocks = ring.alloc_run(position, count, size) if uniform else None
    if blocks is not None:
        offsets: list[int] = []
        errors: list = [None] * count

        def copy_rows(first: int, dest: memoryview, part: range) -> None:  # a block's entries, from head[first]
            errors[first + part.start : first + part.stop] = copy_raw_run(
                head[first + part.start : first + part.stop], dest[part.start * size : part.stop * size])

        for offset, n in blocks:
            split([size] * n, functools.partial(copy_rows, len(offsets), ring.view(offset, n * size)))
            offsets += range(offset, offset + n * size, size)
        return [size] * count, offsets, [(i, exc) for i, exc in enumerate(errors) if exc is not None], 0, ()
    lengths: list[int] = []
    offsets = []
    blocked = total = 0
    for i, view in enumerate(views):
        size = 0 if view is None else served_size(view)
        total += size
        if size > ring.ring_bytes or total > frame_bytes and total > size:
            break
        slot = ring.alloc(position + i, size) if size else 0
        if slot is None:
            blocked = size
            break
        lengths.append(size)
        offsets.append(slot)
    todo = [i for i, n in enumerate(lengths) if n]
    decoded = decode_into([views[i] for i in todo], [ring.view(offsets[i], lengths[i]) for i in todo])
    return lengths, offsets, [(i, exc) for i, exc in zip(todo, decoded) if exc is not None], blocked, ()


def _write_columns(ring: ShmRing, position: int, stored: list) -> tuple[bytes, list[int], EntryHeader, list] | None:
    """A block of the ring for ``stored`` (the entries at ``position`` on) as columns, when they are raw
    entries of one layout and the block fits now without wrapping: ``(their headers, column starts, the
    layout, a writable view per column)``; None (nothing allocated): slots then."""
    layout = uniform_layout(stored) if stored and all(v is not None for v in stored) else None
    if layout is None or layout.codec != Codec.raw:
        return None
    count, size = len(stored), layout.total_len
    nbytes = [spec.nbytes for spec in layout.specs]
    if count * size > ring.ring_bytes or count * sum(nbytes) + COLUMN_ALIGN * len(nbytes) > count * size:
        return None
    block = ring.alloc_block(position, count, size)
    starts = None if block is None else column_starts(nbytes, count, block, block + count * size)
    if block is None or starts is None:
        return None
    heads = b"".join(memoryview(v)[: layout.header_len] for v in stored)
    return heads, starts, layout, [ring.view(at, count * n) for at, n in zip(starts, nbytes)]


def _alloc_run(ring: "ShmRing", header: pb.EntriesHeader, lo: int, count: int, context) -> tuple[int | None, list[int]]:
    """Slots for entries ``lo..hi`` (misses: offset 0), as many as fit now, waiting only for the first:
    ``(hi, offsets)``; ``hi == lo`` when entry ``lo`` is larger than the ring, None if the call ended."""
    offsets: list[int] = []
    for hi in range(lo, count):
        size = header.lengths[hi]
        if size > ring.ring_bytes:
            return hi, offsets
        if size and hi == lo and not ring.wait_room(size, context.is_active, header.start + lo):
            return None, offsets
        offset = ring.alloc(header.start + hi, size) if size else 0
        if offset is None:
            return hi, offsets
        offsets.append(offset)
    return count, offsets
