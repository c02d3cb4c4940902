"""Fetch over shared memory: entries decoded into ring slots, misses in place, frames whole.

In-process: a real store and prefetcher, the daemon's real ``fetch_shm`` on a
real ring, and a client that maps the segment and releases what it read.
"""

import queue
import threading
import time

import numpy as np
import pytest

from actcache._proto import actcache_pb2 as pb
from actcache.codec import DType, TensorSpec, encode_entry
from actcache.served import served_size
from actcache.daemon.config import PrefetchConfig, StoreConfig
from actcache.daemon.prefetch import Prefetcher
from actcache.daemon.prefetch._schedule import Schedule
from actcache.daemon.service._shm_fetch import fetch_shm
from actcache.daemon.store import Store
from actcache.keys import encode_key
from actcache.rpc import decode_frame
from actcache.shm import MIN_RING_BYTES, ClientSegment, ShmRing
from tests.daemon.corrupt import flip_stored_byte

FP = b"D" * 16
N = 600
SPEC = [TensorSpec(DType.float32, (4096,))]  # 16 KiB


def value(i: int) -> bytes:
    return encode_entry(SPEC, [np.full(4096, i, np.float32)])


@pytest.fixture
def store(tmp_path):
    s = Store(StoreConfig(dir=tmp_path / "c", encoding="raw"))
    ns = s.open_namespace("d").id
    s.put(ns, FP, 1, [(i, 0, value(i)) for i in range(0, N, 2)])  # odd ids are misses
    yield s
    s.close()


class Context:
    """What fetch_shm asks of its gRPC context."""

    def is_active(self) -> bool:
        return True


def serve(store, order, tmp_path, *, ring_bytes=1 << 20, frame_bytes=64 << 10, prefetch_bytes=1 << 20, stop_after=None,
          on_frame=None):
    """Push ``order``, Fetch it over shared memory; ``(values by position, namespace counters, reader)``."""
    p = Prefetcher(store, PrefetchConfig(prefetch_bytes=prefetch_bytes, decode_threads=2))
    try:
        p.push(Schedule(1, "e", FP, 1, np.asarray(order, np.uint64), None))
        reader = p.attach(1, "e", 0)
        ring = ShmRing(ring_bytes, 0, directory=tmp_path)
        got, segment = {}, None
        frames = fetch_shm(reader, ring, frame_bytes, Context(), None)
        for frame in frames:
            header_bytes, payload = decode_frame(frame)
            header = pb.EntriesHeader.FromString(bytes(header_bytes))
            segment = segment or ClientSegment(header.segment)
            at = 0
            for i, (offset, n) in enumerate(zip(header.offsets, header.lengths)):
                if n and offset:
                    got[header.start + i] = bytes(segment.view[offset : offset + n])
                elif n:  # larger than the ring: in the payload
                    got[header.start + i] = bytes(payload[at : at + n])
                    at += n
                else:
                    got[header.start + i] = None
            segment.release(header.start + len(header.lengths))
            if on_frame is not None:
                on_frame(reader)
            if stop_after is not None and len(got) >= stop_after:
                frames.close()
                break
        ring.close()
        return got, p.stats().namespaces[1], reader
    finally:
        p.close()


def expected(order):
    return {pos: value(i) if i % 2 == 0 else None for pos, i in enumerate(order)}


def test_a_stream_is_served_in_order_with_misses_in_place(store, tmp_path):
    order = np.random.default_rng(1).permutation(N)
    got, counters, _ = serve(store, order, tmp_path)
    assert got == expected(order)
    assert (counters["hits"], counters["misses"], counters["corrupt"]) == (N // 2, N // 2, 0)
    assert counters["ready_on_ask"] + counters["stalls"] >= N


def test_a_full_ring_is_waited_for_and_the_stream_goes_on(store, tmp_path):
    order = np.arange(N)
    got, counters, _ = serve(store, order, tmp_path, ring_bytes=MIN_RING_BYTES, frame_bytes=256 << 10)
    assert got == expected(order)


def test_an_entry_larger_than_the_ring_is_served_in_its_frame(tmp_path):
    s = Store(StoreConfig(dir=tmp_path / "c", encoding="raw"))
    big = TensorSpec(DType.float32, (40_000,))  # 160 KB: larger than the smallest ring
    values = {i: encode_entry([big], [np.full(40_000, i, np.float32)]) if i == 450 else value(i) for i in range(N)}
    try:
        s.put(s.open_namespace("d").id, FP, 1, list((i, 0, v) for i, v in values.items()))
        got, counters, _ = serve(s, np.arange(N), tmp_path, ring_bytes=MIN_RING_BYTES)
    finally:
        s.close()
    assert got == values
    assert counters["hits"] == N


def test_a_corrupt_entry_is_a_counted_miss_and_deleted(store, tmp_path):
    flip_stored_byte(store, encode_key(1, FP, 1, 200), tmp_path / "c" / "data.mdb")
    order = np.arange(N)
    got, counters, _ = serve(store, order, tmp_path)
    want = expected(order)
    want[200] = None
    assert got == want
    assert (counters["hits"], counters["corrupt"]) == (N // 2 - 1, 1)
    assert store.get(1, FP, 1, [(200, 0)]) == [None]


def serve_threaded(store, order, tmp_path, per_frame: int, on_frame, *, whole_frames: bool = False):
    """Fetch ``order`` over shared memory in frames of ``per_frame`` entries, fetch_shm in a thread of
    its own as under gRPC (a 1 MiB ring: about 7 frames); ``on_frame(index, header, segment)`` is the
    consumer's work on each frame before it releases it. ``(spans (start, entries), counters)``."""
    frame_bytes = per_frame * served_size(memoryview(value(0)))
    p = Prefetcher(store, PrefetchConfig(prefetch_bytes=1 << 20, decode_threads=2))
    try:
        p.push(Schedule(1, "e", FP, 1, np.asarray(order, np.uint64), None))
        ring = ShmRing(1 << 20, 0, directory=tmp_path)
        frames: queue.Queue = queue.Queue()

        def produce():  # gRPC's part: send frames as fetch_shm yields them
            for frame in fetch_shm(p.attach(1, "e", 0), ring, frame_bytes, Context(), None, whole_frames=whole_frames):
                frames.put(frame)
            frames.put(None)

        threading.Thread(target=produce, daemon=True).start()
        spans, segment = [], None
        while (frame := frames.get(timeout=30)) is not None:
            header = pb.EntriesHeader.FromString(bytes(decode_frame(frame)[0]))
            segment = segment or ClientSegment(header.segment)
            on_frame(len(spans), header, segment)
            spans.append((header.start, len(header.lengths)))
            segment.release(header.start + len(header.lengths))
        ring.close()
        return spans, p.stats().namespaces[1]
    finally:
        p.close()


@pytest.mark.parametrize("whole_frames", [False, True])
def test_a_held_stream_cuts_a_frame_short_after_its_patience_unless_asked_for_whole_frames(store, tmp_path,
                                                                                          whole_frames):
    """A consumer holding its first frame past the 0.5 s patience (a stream opened ahead of its use)
    gets a frame cut to what fits the ring, and the batch after it spans two frames; with
    FetchRequest.whole_frames every frame waits for room for all of it."""
    order = np.arange(0, N, 2)  # all stored: uniform entries
    per_frame = 8

    def hold_the_first(index, header, segment):
        if index == 0:
            time.sleep(1.0)  # the daemon fills the ring meanwhile

    spans, _ = serve_threaded(store, order, tmp_path, per_frame, hold_the_first, whole_frames=whole_frames)
    assert sum(n for _, n in spans) == len(order)
    # the ring (about 7 frames) fills while the first is held: the frame that finds it full is cut, or waits
    cut = [start for start, n in spans[:10] if n != per_frame or start % per_frame]
    assert cut == [] if whole_frames else cut


def test_frames_of_a_slower_consumer_stay_whole_and_aligned(store, tmp_path):
    """The ring fills while the consumer works: each frame waits for room for all of it rather than
    going out short, so frames of one batch's bytes stay one batch each."""
    order = np.arange(0, N, 2)  # all stored: uniform entries
    per_frame = 8

    def train(index, header, segment):
        for i, (offset, n) in enumerate(zip(header.offsets, header.lengths)):
            assert bytes(segment.view[offset : offset + n]) == value(int(order[header.start + i]))
        time.sleep(0.002)  # the training step

    spans, _ = serve_threaded(store, order, tmp_path, per_frame, train)
    assert sum(n for _, n in spans) == len(order)
    whole = [start % per_frame == 0 and n == per_frame for start, n in spans]
    assert sum(whole) >= len(spans) - 3  # at most the stream's first frames, before the reader is ahead


def test_compressed_entries_are_decoded_with_the_decode_pools_help(tmp_path, monkeypatch):
    from actcache.codec import decode_entry
    from actcache.daemon.prefetch import _served

    threads: set[str] = set()
    decode = _served.to_raw_entries_into

    def recording(values, outs):
        threads.add(threading.current_thread().name)
        return decode(values, outs)

    monkeypatch.setattr(_served, "to_raw_entries_into", recording)

    def relu(i: int) -> np.ndarray:  # compresses about 1.5x, as ReLU maps do: values stay in overflow pages
        return np.maximum(np.random.default_rng(i).standard_normal(4096, np.float32), 0)

    store = Store(StoreConfig(dir=tmp_path / "c", encoding="lz4"))
    try:
        ns = store.open_namespace("d").id
        store.put(ns, FP, 1, [(i, 0, encode_entry(SPEC, [relu(i)])) for i in range(0, N, 2)])
        order = list(range(N))
        got, counters, _ = serve(store, order, tmp_path, ring_bytes=4 << 20, frame_bytes=512 << 10)
    finally:
        store.close()
    for pos, i in enumerate(order):
        if i % 2:
            assert got[pos] is None
        else:
            _, raw = decode_entry(got[pos])
            assert np.array_equal(np.frombuffer(raw, np.float32), relu(i)), pos
    assert counters["corrupt"] == 0
    assert any(name.startswith("actcache-decode") for name in threads) and len(threads) > 1
