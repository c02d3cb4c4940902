"""Fetch over shared memory: the ring a stream's entries are decoded into, and its frames of slot descriptors."""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

from actcache._proto import actcache_pb2 as pb
from actcache.rpc import encode_frame
from actcache.shm import ShmRing, reusable

if TYPE_CHECKING:
    from actcache.daemon.service._throttle import Throttle

__all__ = ["ParkedRings", "fetch_shm", "ring_for"]

# How long a frame waits for the client to release room for all of it (ShmRing.wait_frame_room):
# longer than a training step usually takes between two frames; a client holding several frames
# on purpose gets what fits after it.
_WHOLE_FRAME_PATIENCE_S = 0.5


class ParkedRings:
    """Rings whose stream ended after its client mapped them, kept for that client's next Fetch
    (``FetchRequest.reuse_segment``; see actcache.shm). Thread-safe.

    A ring waits at most ``idle_s`` (a thread closes it after that) and at most ``max_bytes`` of
    rings wait (the oldest go first): a client that went away costs that memory for a while only.
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
        """The parked ring named ``path`` if it serves a ring of ``ring_bytes`` (``reusable``; it is no
        longer parked), else None."""
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

    Each frame waits a while for room for all of it while earlier frames are still held (the
    client releases a frame when it asks for the next), so frames stay whole; when the ring is
    full of the frame's own entries, or the client keeps holding, what fits goes out (so the
    client can release it) before waiting. ``whole_frames`` (FetchRequest.whole_frames): a
    frame waits for room for all of it as long as the client holds (a stream opened ahead of
    its use fills its ring and waits, rather than cutting its next frame short). An entry larger than the whole ring travels alone in
    a frame of its own, in the payload (offset 0), so no entry size ends the stream.
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
    for batch in reader.batches(frame_bytes, fill_whole=True):
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


def _alloc_run(ring: "ShmRing", header: pb.EntriesHeader, lo: int, count: int, context) -> tuple[int | None, list[int]]:
    """Ring slots for entries ``lo..hi`` (misses get offset 0): as many as fit now, waiting only for the
    first. Returns ``(hi, offsets)``; ``hi == lo`` when entry ``lo`` is larger than the ring, None if
    the call ended while waiting."""
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
