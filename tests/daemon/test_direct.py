"""Direct runs: a warm stream served over shared memory is read by the Fetch thread itself, one pass per frame.

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
from actcache.daemon.config import PrefetchConfig, StoreConfig
from actcache.daemon.prefetch import Prefetcher
from actcache.daemon.prefetch._reader import ReaderState
from actcache.daemon.prefetch._schedule import Schedule
from actcache.daemon.service._shm_fetch import fetch_shm
from actcache.daemon.store import PageCacheGuess, Store
from actcache.keys import encode_key
from actcache.rpc import decode_frame
from actcache.served import copy_raw_run, served_size
from actcache.shm import MIN_RING_BYTES, ClientSegment, ShmRing
from actcache.testing import wait_until
from tests.daemon.corrupt import flip_stored_byte

FP = b"D" * 16
N = 600  # the reader thread is at most ~160 positions ahead when the consumer takes over (1 MiB budget)
SPEC = [TensorSpec(DType.float32, (4096,))]  # 16 KiB


def value(i: int) -> bytes:
    return encode_entry(SPEC, [np.full(4096, i, np.float32)])


@pytest.fixture(autouse=True)
def warm_after_two_reads(monkeypatch):
    monkeypatch.setattr(PageCacheGuess, "WARM_AFTER", 2)


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


def test_a_warm_stream_is_read_by_the_fetch_thread_with_misses_in_place(store, tmp_path):
    order = np.random.default_rng(1).permutation(N)
    got, counters, _ = serve(store, order, tmp_path)
    assert got == expected(order)
    assert (counters["hits"], counters["misses"], counters["corrupt"]) == (N // 2, N // 2, 0)
    assert counters["direct"] > N // 2  # after the first runs, the Fetch thread read the rest itself
    assert counters["ready_on_ask"] + counters["stalls"] >= N


def test_a_full_ring_is_waited_for_and_the_stream_goes_on(store, tmp_path):
    order = np.arange(N)
    got, counters, _ = serve(store, order, tmp_path, ring_bytes=MIN_RING_BYTES, frame_bytes=256 << 10)
    assert got == expected(order)
    assert counters["direct"] > N // 2


def test_values_that_seem_cold_go_back_to_the_reader_thread(store, tmp_path, monkeypatch):
    monkeypatch.setattr(PageCacheGuess, "CHECK_EVERY", 8)
    direct_when_cold = []  # once set, the kernel says no value is in the page cache any more
    read = store._file.read
    monkeypatch.setattr(store._file, "resident", lambda extent: not direct_when_cold)
    monkeypatch.setattr(store._file, "read", lambda extent: (read(extent)[0], not direct_when_cold))

    def evict_once_direct(reader):
        direct = reader.schedule.counters.snapshot()["direct"]
        if direct and not direct_when_cold:
            direct_when_cold.append(direct)

    order = np.arange(N)
    got, counters, _ = serve(store, order, tmp_path, on_frame=evict_once_direct)
    assert got == expected(order)
    # direct runs (3 entries a frame here) stop at the next check, due every 8 lookups; the reader reads the rest
    assert direct_when_cold and direct_when_cold[0] <= counters["direct"] <= direct_when_cold[0] + 7


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
    assert counters["direct"] > 0 and counters["hits"] == N


def test_a_corrupt_entry_read_directly_is_a_counted_miss_and_deleted(store, tmp_path):
    flip_stored_byte(store, encode_key(1, FP, 1, 200), tmp_path / "c" / "data.mdb")
    order = np.arange(N)
    got, counters, _ = serve(store, order, tmp_path)
    want = expected(order)
    want[200] = None
    assert got == want
    assert (counters["hits"], counters["corrupt"]) == (N // 2 - 1, 1) and counters["direct"] > 0
    assert store.get(1, FP, 1, [(200, 0)]) == [None]


def test_a_corrupt_entry_among_uniform_ones_is_a_counted_miss_and_the_others_are_served(store, tmp_path, monkeypatch):
    """Frames of stored raw entries of one size are copied and verified as one block (copy_raw_run)."""
    from actcache.daemon.service import _shm_fetch

    runs = []
    monkeypatch.setattr(_shm_fetch, "copy_raw_run", lambda bufs, dest: runs.append(len(bufs)) or copy_raw_run(bufs, dest))
    flip_stored_byte(store, encode_key(1, FP, 1, 200), tmp_path / "c" / "data.mdb")
    order = np.arange(0, N, 2)  # all stored
    got, counters, _ = serve(store, order, tmp_path)
    want = {pos: value(int(i)) for pos, i in enumerate(order)}
    want[100] = None  # sample 200
    assert got == want
    assert (counters["hits"], counters["corrupt"]) == (N // 2 - 1, 1) and counters["direct"] > 0
    assert store.get(1, FP, 1, [(200, 0)]) == [None]
    assert sum(runs) == counters["direct"] and max(runs) == (64 << 10) // served_size(value(0))  # whole frames


def test_a_warm_groups_next_schedule_is_not_read_ahead_but_served_directly_from_its_start(store, tmp_path,
                                                                                          monkeypatch):
    """The next epoch's order, pushed while its group is warm, is not copied into read-ahead buffers
    before its Fetch comes: the Fetch reads all of it from the store itself, in whole frames."""
    from actcache.daemon.prefetch._read_loop import ReadLoop

    parked = threading.Event()  # the reader of "next" stopped reading ahead until its consumer comes
    warm_without_consumer = ReadLoop._warm_without_consumer

    def noting_the_park(loop):
        stop = warm_without_consumer(loop)
        if stop and loop._schedule.schedule_id == "next":
            parked.set()
        return stop

    monkeypatch.setattr(ReadLoop, "_warm_without_consumer", noting_the_park)
    order = np.arange(0, N, 2)  # all stored
    p = Prefetcher(store, PrefetchConfig(prefetch_bytes=16 << 20, decode_threads=2))
    try:
        for schedule_id in ("first", "next"):
            p.push(Schedule(1, schedule_id, FP, 1, np.asarray(order, np.uint64), None))
            if schedule_id == "next":
                # room in the budget for every entry: a reader of cold data would read them all
                wait_until(lambda: parked.is_set() or {s.schedule_id: s.reader.state for s in p.stats().schedules}
                           ["next"] is ReaderState.READ_ALL, what="the reader parked, or read every entry")
                before = p.stats().namespaces[1]
            ring = ShmRing(1 << 20, 0, directory=tmp_path)
            segment = None
            for frame in fetch_shm(p.attach(1, schedule_id, 0), ring, 64 << 10, Context(), None):
                header = pb.EntriesHeader.FromString(bytes(decode_frame(frame)[0]))
                segment = segment or ClientSegment(header.segment)
                for i, (offset, n) in enumerate(zip(header.offsets, header.lengths)):
                    assert bytes(segment.view[offset : offset + n]) == value(int(order[header.start + i]))
                segment.release(header.start + len(header.lengths))
            ring.close()
        after = p.stats().namespaces[1]
    finally:
        p.close()
    assert after["hits"] - before["hits"] == len(order)
    assert after["direct"] - before["direct"] == len(order)


def test_a_consumer_that_leaves_gives_reading_back(store, tmp_path):
    got, counters, reader = serve(store, np.arange(N), tmp_path, stop_after=400)
    assert counters["direct"] > 0 and len(got) >= 400
    # the reader thread was parked for the consumer; released, it reads on to the end of the order
    wait_until(lambda: reader.snapshot().read == N or reader.state in (ReaderState.CANCELLED, ReaderState.READ_ALL))
    assert not reader._handover.parked


def serve_threaded(store, order, tmp_path, per_frame: int, on_frame, *, whole_frames: bool = False,
                   sent_at: list | None = None):
    """Fetch ``order`` over shared memory in frames of ``per_frame`` entries, fetch_shm in a thread of
    its own as under gRPC (a 1 MiB ring: about 7 frames); ``on_frame(index, header, segment)`` is the
    consumer's work on each frame before it releases it. ``(spans (start, entries), counters)``;
    ``sent_at`` gets each frame's time.monotonic() when fetch_shm yielded it."""
    frame_bytes = per_frame * served_size(memoryview(value(0)))
    p = Prefetcher(store, PrefetchConfig(prefetch_bytes=1 << 20, decode_threads=2))
    try:
        p.push(Schedule(1, "e", FP, 1, np.asarray(order, np.uint64), None))
        ring = ShmRing(1 << 20, 0, directory=tmp_path)
        frames: queue.Queue = queue.Queue()

        def produce():  # gRPC's part: send frames as fetch_shm yields them
            for frame in fetch_shm(p.attach(1, "e", 0), ring, frame_bytes, Context(), None, whole_frames=whole_frames):
                if sent_at is not None:
                    sent_at.append(time.monotonic())
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
@pytest.mark.slow
def test_a_held_stream_cuts_a_frame_short_after_its_patience_unless_asked_for_whole_frames(store, tmp_path,
                                                                                          whole_frames):
    """A consumer holding its first frame past the 0.5 s patience (a stream opened ahead of its use)
    gets a frame cut to what fits the ring, and the batch after it spans two frames; with
    FetchRequest.whole_frames every frame sent while the ring is full waits for room for all of it.
    (Later, when the stream turns to reading straight into the ring, one frame may end where the entries
    read ahead end, whatever the room: that is not what whole_frames is about.)"""
    order = np.arange(0, N, 2)  # all stored: uniform entries
    per_frame = 8
    sent_at, held_until = [], []

    def hold_the_first(index, header, segment):
        if index == 0:
            time.sleep(1.0)  # the daemon fills the ring meanwhile
            held_until.append(time.monotonic())

    spans, _ = serve_threaded(store, order, tmp_path, per_frame, hold_the_first, whole_frames=whole_frames,
                              sent_at=sent_at)
    assert sum(n for _, n in spans) == len(order)
    while_held = [span for span, at in zip(spans, sent_at, strict=True) if at < held_until[0]]
    assert len(while_held) > 1  # the ring filled while the first frame was held
    cut = [start for start, n in while_held if n != per_frame or start % per_frame]
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

    spans, counters = serve_threaded(store, order, tmp_path, per_frame, train)
    assert sum(n for _, n in spans) == len(order)
    assert counters["direct"] > len(order) // 2
    whole = [start % per_frame == 0 and n == per_frame for start, n in spans]
    assert sum(whole) >= len(spans) - 3  # at most the stream's first frames, before it ran direct


def test_a_warm_stream_of_compressed_entries_is_decoded_with_the_decode_pools_help(tmp_path, monkeypatch):
    from actcache.codec import decode_entry
    from actcache.daemon.prefetch import _frames

    threads: set[str] = set()
    decode = _frames.to_raw_entries_into

    def recording(values, outs):
        threads.add(threading.current_thread().name)
        return decode(values, outs)

    monkeypatch.setattr(_frames, "to_raw_entries_into", recording)

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
    assert counters["direct"] > N // 2 and counters["corrupt"] == 0  # read by the Fetch thread itself
    assert any(name.startswith("actcache-decode") for name in threads) and len(threads) > 1


def test_what_a_parked_reader_read_is_served_at_once_not_after_waiting_for_a_fuller_frame(store, tmp_path, monkeypatch):
    """A warm group's next stream: its reader reads one run and parks for the Fetch to read on. Before, the
    Fetch waited out _LINGER_S for a frame's worth that the parked reader would never add (5 ms a stream)."""
    from actcache.daemon.prefetch import _frames

    monkeypatch.setattr(_frames, "_LINGER_S", 60.0)  # a wait for a fuller frame would now outlast the test
    # 2 MiB: the reader holds at most ~320 of the N positions, so however far it runs before the Fetch
    # starts (a loaded machine), the rest of the stream is served by the Fetch's direct runs.
    p = Prefetcher(store, PrefetchConfig(prefetch_bytes=2 << 20, decode_threads=1))
    ring = ShmRing(4 << 20, 0, directory=tmp_path)
    segment = ClientSegment(str(ring.path))
    try:
        for rep in range(2):  # the first stream leaves the group warm
            order = np.random.default_rng(rep).permutation(N).astype(np.uint64)
            p.push(Schedule(1, f"p{rep}", FP, 1, order, None))
            reader = p.attach(1, f"p{rep}", 0)
            ring.restart(0, 4 << 20)
            served: list[int] = []

            def fetch(reader=reader, served=served) -> None:
                for frame in fetch_shm(reader, ring, 1 << 20, Context(), None):
                    header = pb.EntriesHeader.FromString(bytes(decode_frame(frame)[0]))
                    served.append(len(header.lengths))
                    segment.release(header.start + len(header.lengths))

            thread = threading.Thread(target=fetch, daemon=True)
            thread.start()
            thread.join(timeout=30)
            assert not thread.is_alive(), f"stream {rep} waited for a fuller frame after {sum(served)} entries"
            assert sum(served) == N
        assert reader.schedule.counters.snapshot()["direct"] > 0
    finally:
        p.close()
        ring.close()


@pytest.mark.parametrize("columns", [True, False])
def test_a_large_uniform_frame_is_copied_by_two_threads_and_each_half_verified(tmp_path, columns):
    """The decode pool copies the second half of a large frame (numpy copies and checksums release the
    interpreter lock); a corrupt entry there is still a miss of its own, the other entries are intact."""
    from concurrent.futures import ThreadPoolExecutor

    from actcache.codec import encode_batch
    from actcache.daemon.prefetch._served import split_with
    from actcache.daemon.service._shm_fetch import _copy_views

    count, floats = 16, 16 << 10  # 64 KiB per entry, 1 MiB per frame: above the split threshold
    payload = np.random.default_rng(0).standard_normal((count, floats), dtype=np.float32)
    entries = [bytes(row) for row in encode_batch([TensorSpec(DType.float32, (floats,))], [payload.view(np.uint8)])]
    broken = bytearray(entries[12])
    broken[-1] ^= 0xFF
    entries[12] = bytes(broken)
    parts = []
    with ThreadPoolExecutor(1) as pool:
        def split(sizes, run):
            split_with(pool, range(len(sizes)), sizes, lambda part: parts.append(part) or run(part))

        ring = ShmRing(4 << 20, 0, directory=tmp_path)
        try:
            lengths, offsets, corrupt, blocked, laid = _copy_views(
                0, [memoryview(e) for e in entries], ring, 4 << 20, lambda values, outs: [], split, columns)
            assert sorted((p.start, p.stop) for p in parts) == [(0, 8), (8, 16)]  # two halves, one on the pool
            assert lengths == [len(entries[0])] * count and blocked == 0
            assert [i for i, _ in corrupt] == [12]
            if columns:
                (_, starts) = laid
                got = np.frombuffer(ring.view(starts[0], count * floats * 4), np.float32).reshape(count, floats)
            else:
                hlen = len(entries[0]) - floats * 4
                got = np.stack([np.frombuffer(ring.view(o + hlen, floats * 4), np.float32) for o in offsets])
            ok = [i for i in range(count) if i != 12]
            assert np.array_equal(got[ok], payload[ok])
        finally:
            ring.close()
