"""Fetch over shared memory: the ring a stream's entries are decoded into, and its frames of slot descriptors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from actcache._proto import actcache_pb2 as pb
from actcache.rpc import encode_frame
from actcache.shm import ShmRing

if TYPE_CHECKING:
    from actcache.daemon.service._throttle import Throttle

__all__ = ["fetch_shm", "ring_for"]


def ring_for(request: pb.FetchRequest, context) -> tuple["ShmRing | None", str]:
    """A shared-memory ring for this Fetch, or None and why the bytes path is taken."""
    if not request.shared_memory:
        return None, "not asked for"
    if not context.peer().startswith("unix:"):
        return None, f"client is not on this host's Unix socket ({context.peer()})"
    try:
        return ShmRing(request.ring_bytes, request.start), ""
    except OSError as exc:
        return None, f"shared memory unavailable: {exc}"

def fetch_shm(reader, ring: "ShmRing", frame_bytes: int, context, throttle: "Throttle | None") -> Iterator[bytes]:
    """Frames of slot descriptors: each entry is decoded into its slot once the slot is free.

    When the ring is full, the entries already written go out in a frame (so the client can
    release their slots) before waiting. An entry larger than the whole ring travels alone in
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

    for batch in reader.batches(frame_bytes):
        header, count, lo = batch.header, len(batch.stored), 0
        ring.poll()
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
