"""The prefetcher in-process, over a real LMDB store: order, misses, budget, turns, cancellation, failures."""

import threading
from contextlib import contextmanager

import numpy as np
import pytest

import actcache.daemon.prefetch._readahead as readahead
from actcache.codec import Codec, DType, TensorSpec, decode_entry, encode_entry
from actcache.daemon.config import PrefetchConfig, StoreConfig
from actcache.daemon.prefetch import Prefetcher
from actcache.daemon.prefetch._reader import ReaderState
from actcache.daemon.prefetch._schedule import Schedule
from actcache.daemon.store import Store
from actcache.entries import EntryBatch
from actcache.errors import BudgetExceeded, FetchAborted, ScheduleNotFound, StoreError
from actcache.keys import encode_key
from actcache.testing import wait_until
from tests.daemon.corrupt import flip_stored_byte

FP = b"P" * 16
SPEC = [TensorSpec(DType.float32, (16, 32, 32))]  # 64 KiB raw


def tensor(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return np.maximum(rng.standard_normal((16, 32, 32), dtype=np.float32), 0)


@pytest.fixture
def store(tmp_path):
    s = Store(StoreConfig(dir=tmp_path / "c", encoding="zstd"))
    ns = s.open_namespace("p").id
    s.put(ns, FP, 1, [(i, 0, encode_entry(SPEC, [tensor(i)])) for i in range(0, 120, 2)])  # odd ids are misses
    yield s
    s.close()


@contextmanager
def prefetcher_of(store, **config):
    p = Prefetcher(store, PrefetchConfig(**{"decode_threads": 2, **config}))
    try:
        yield p
    finally:
        p.close()


def schedule(ids, sid="e0", ns=1) -> Schedule:
    return Schedule(ns, sid, FP, 1, np.asarray(ids, np.uint64), None)


def consume(reader, max_frame_bytes=1 << 20, each=None):
    out = []
    for frame in reader.frames(max_frame_bytes):
        batch = EntryBatch.from_frame(frame)
        for pos, sid, _, value in batch:
            if value is None:
                out.append((pos, sid, None))
            else:
                header, raw = decode_entry(value)
                assert header.codec in (Codec.raw, Codec.raw_verified)  # uncompressed either way
                out.append((pos, sid, np.frombuffer(raw, np.float32).reshape(16, 32, 32).copy()))
            if each:
                each()
    return out


def check_invariants(p: Prefetcher) -> None:
    stats = p.stats()
    assert 0 <= stats.buffered_bytes <= stats.max_buffered_bytes <= stats.budget_bytes
    for status in stats.schedules:
        r = status.reader
        if r is not None:
            assert r.start <= r.served <= r.ready <= r.read <= r.length
            assert r.read - r.served <= readahead.MAX_AHEAD_ENTRIES


def test_entries_come_in_order_with_misses_in_place(store):
    order = np.random.default_rng(0).permutation(120)
    with prefetcher_of(store) as p:
        p.push(schedule(order))
        got = consume(p.attach(1, "e0", 0))
    assert [pos for pos, _, _ in got] == list(range(120))
    assert [sid for _, sid, _ in got] == order.tolist()
    for _, sid, value in got:
        if sid % 2:
            assert value is None
        else:
            np.testing.assert_array_equal(value, tensor(sid))


def test_resume_from_a_position(store):
    with prefetcher_of(store) as p:
        p.push(schedule(range(40)))
        got = consume(p.attach(1, "e0", 25))
    assert [pos for pos, _, _ in got] == list(range(25, 40))


def test_invariants_and_budget_under_a_slow_consumer(store):
    limit = 1 << 20  # room for about 15 of the 64 KiB entries
    with prefetcher_of(store, prefetch_bytes=limit) as p:
        p.push(schedule(range(0, 120, 2)))
        reader = p.attach(1, "e0", 0)
        got = consume(reader, max_frame_bytes=64 << 10, each=lambda: check_invariants(p))
        assert len(got) == 60
        stats = p.stats()
        assert 0 < stats.max_buffered_bytes <= limit
        assert stats.buffered_bytes == 0


def test_budget_is_shared_by_concurrent_schedules(store):
    limit = 1 << 20
    results, errors = {}, []
    with prefetcher_of(store, prefetch_bytes=limit) as p:
        orders = {f"r{k}": np.random.default_rng(k).permutation(120) for k in range(4)}
        for sid, order in orders.items():
            p.push(schedule(order, sid))

        def run(sid):
            try:
                results[sid] = consume(p.attach(1, sid, 0), max_frame_bytes=128 << 10, each=lambda: check_invariants(p))
            except Exception as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(sid,)) for sid in orders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = p.stats()
    assert errors == []
    for sid, order in orders.items():
        assert [s for _, s, _ in results[sid]] == order.tolist()
    assert 0 < stats.max_buffered_bytes <= limit
    assert stats.buffered_bytes == 0


def test_cancelled_consumer_frees_memory_at_once(store):
    with prefetcher_of(store) as p:
        p.push(schedule(range(0, 120, 2)))
        reader = p.attach(1, "e0", 0)
        frames = reader.frames(64 << 10)
        next(frames)
        wait_until(lambda: reader.snapshot().state is ReaderState.READ_ALL)
        assert p.stats().buffered_bytes > 0
        reader.cancel()
        wait_until(lambda: p.stats().buffered_bytes == 0)
        assert list(frames) == []  # the stream ends quietly
        assert reader.snapshot().state is ReaderState.CANCELLED


def test_next_epoch_reads_once_the_current_one_is_read(store):
    with prefetcher_of(store, prefetch_bytes=1 << 20) as p:
        p.push(schedule(range(0, 120, 2), "e0"))
        current = p.attach(1, "e0", 0)
        frames = current.frames(64 << 10)
        next(frames)  # the consumer is slow: e0 fills its budget and waits
        p.push(schedule(range(0, 40, 2), "e1"))
        stats = {s.schedule_id: s.reader for s in p.stats().schedules}
        assert stats["e0"].state is ReaderState.READING and stats["e1"].state is ReaderState.WAITING
        rest = list(frames)
        assert sum(len(EntryBatch.from_frame(f)) for f in rest) == 59
        # e0 is read (and served): e1 reads ahead, before any Fetch, as far as its budget allows.
        wait_until(lambda: p.stats().schedules[0].reader.ready > 0)
        following = p.attach(1, "e1", 0)
        got = consume(following)
        counters = {s.schedule_id: s.counters for s in p.stats().schedules}
    assert [s for _, s, _ in got] == list(range(0, 40, 2))
    assert "e0" not in counters  # served to its end: retired


def test_next_epoch_is_ready_before_it_is_fetched(store):
    with prefetcher_of(store) as p:
        p.push(schedule(range(0, 120, 2), "e0"))
        list(p.attach(1, "e0", 0).frames(1 << 20))
        p.push(schedule(range(0, 40, 2), "e1"))
        wait_until(lambda: p.stats().schedules[0].reader.ready == 20)
        consume(p.attach(1, "e1", 0))
        ns = p.stats().namespaces[1]
    # Served e0 (60) then e1 (20): every e1 entry was ready when asked.
    assert ns["hits"] == 80 and ns["misses"] == 0
    assert ns["ready_on_ask"] >= 20


def test_pushing_again_replaces_and_aborts_the_old_stream(store):
    with prefetcher_of(store) as p:
        p.push(schedule(range(0, 120, 2)))
        old = p.attach(1, "e0", 0).frames(64 << 10)
        next(old)
        assert p.push(schedule([4, 2, 0])) is True
        with pytest.raises(FetchAborted, match="replaced by a new push"):
            list(old)
        assert [s for _, s, _ in consume(p.attach(1, "e0", 0))] == [4, 2, 0]
        with pytest.raises(ScheduleNotFound, match="served to its end"):
            p.attach(1, "e0", 0)


def test_a_second_fetch_takes_over(store):
    with prefetcher_of(store) as p:
        p.push(schedule(range(0, 120, 2)))
        first = p.attach(1, "e0", 0).frames(64 << 10)
        next(first)
        second = p.attach(1, "e0", 10)
        with pytest.raises(FetchAborted, match="newer Fetch"):
            list(first)
        assert consume(second)[0][0] == 10


class _FailingStore:
    """A store whose lookups (``in_read``: reads, the entries' budget bytes taken) fail after ``ok`` of them,
    as a dying disk would; lookups wait for ``go``."""

    def __init__(self, store: Store, ok: int, error: Exception, in_read: bool = False) -> None:
        self._store, self._left, self._error, self._in_read = store, ok, error, in_read
        self.config = store.config
        self.generations = store.generations
        self.go = threading.Event()

    def probe(self, keys, hints=None, start=0):
        return [None] * len(keys)

    def discard_corrupt(self, keys):
        return self._store.discard_corrupt(keys)

    @contextmanager
    def read_session(self, guess=None):
        outer = self

        class Session:
            def __init__(self, inner):
                self._inner = inner

            def locate(self, key):
                outer.go.wait()
                if not outer._in_read:
                    outer.count_down()
                return self._inner.locate(key)

            def read(self, key, extent):
                if outer._in_read:
                    outer.count_down()
                return self._inner.read(key, extent)

            def copy_run(self, keys):  # reading entry by entry, through read()
                return None if outer._in_read else self._inner.copy_run(keys)

            @property
            def last_resident(self):
                return self._inner.last_resident

        with self._store.read_session(guess) as inner:
            yield Session(inner)

    def count_down(self) -> None:
        if self._left <= 0:
            raise self._error
        self._left -= 1


@pytest.mark.parametrize("in_read", [False, True], ids=["lookup", "read"])
@pytest.mark.parametrize("error, expected, match", [
    (StoreError("the disk went away"), StoreError, "the disk went away"),
    (OSError(5, "Input/output error"), StoreError, "failed at position 7.*Input/output error"),
])
def test_a_failing_reader_is_an_error_on_the_stream_after_what_it_read(store, error, expected, match, in_read):
    """... and gives back every budget byte, also those taken for the entry whose read failed."""
    failing = _FailingStore(store, 7, error, in_read)
    with prefetcher_of(failing) as p:
        p.push(schedule(range(0, 40, 2)))
        reader = p.attach(1, "e0", 0)
        failing.go.set()  # a reader failing before its Fetch is dropped (a Fetch reads again): fail after it
        got = []
        with pytest.raises(expected, match=match):
            for frame in reader.frames(1 << 20):
                got.extend(EntryBatch.from_frame(frame))
        assert [pos for pos, *_ in got] == list(range(7))
        wait_until(lambda: p.stats().buffered_bytes == 0)


def test_entries_dropped_while_fetching_become_misses(store):
    with prefetcher_of(store, prefetch_bytes=1 << 20) as p:
        p.push(schedule(range(0, 120, 2)))
        frames = p.attach(1, "e0", 0).frames(64 << 10)
        first = EntryBatch.from_frame(next(frames))
        store.drop(1)
        rest = [v for f in frames for v in EntryBatch.from_frame(f).values]
    assert first.values[0] is not None
    assert len(rest) == 60 - len(first) and rest[-1] is None


def test_corrupt_entry_is_a_counted_miss_and_deleted(store, tmp_path):
    flip_stored_byte(store, encode_key(1, FP, 1, 4), tmp_path / "c" / "data.mdb")
    with prefetcher_of(store) as p:
        p.push(schedule([2, 4, 6]))
        got = consume(p.attach(1, "e0", 0))
        ns = p.stats().namespaces[1]
    assert [v is None for _, _, v in got] == [False, True, False]
    assert (ns["hits"], ns["misses"], ns["corrupt"]) == (2, 1, 1)
    assert store.get(1, FP, 1, [(4, 0)]) == [None]


def test_an_entry_larger_than_the_budget_fails_clearly(tmp_path):
    s = Store(StoreConfig(dir=tmp_path / "big", encoding="raw"))
    try:
        ns = s.open_namespace("big").id
        s.put(ns, FP, 1, [(0, 0, encode_entry([TensorSpec(DType.uint8, (2 << 20,))], [bytes(2 << 20)]))])
        with prefetcher_of(s, prefetch_bytes=1 << 20) as p:
            p.push(schedule([0], ns=ns))
            with pytest.raises(BudgetExceeded, match="more than the whole prefetch budget.*raise --prefetch-bytes"):
                list(p.attach(ns, "e0", 0).frames(1 << 20))
    finally:
        s.close()


def test_read_ahead_of_misses_is_bounded_in_entries(store, monkeypatch):
    monkeypatch.setattr(readahead, "MAX_AHEAD_ENTRIES", 100)
    with prefetcher_of(store) as p:
        p.push(schedule(range(1001, 3001, 2)))  # 1000 misses: no budget bytes at all
        wait_until(lambda: p.stats().schedules[0].reader.read == 100)
        status = p.stats().schedules[0].reader
        assert status.state is ReaderState.READING and status.read == 100
        got = consume(p.attach(1, "e0", 0), each=lambda: check_invariants(p))
    assert len(got) == 1000 and all(v is None for _, _, v in got)


def test_read_ahead_without_a_consumer_gives_its_budget_to_a_fetch(store):
    """Schedules pushed and never fetched fill the budget; a Fetch of another namespace still gets served."""
    other = store.open_namespace("q").id
    store.put(other, FP, 1, [(i, 0, encode_entry(SPEC, [tensor(i)])) for i in range(8)])
    with prefetcher_of(store, prefetch_bytes=1 << 20) as p:
        p.push(schedule(range(0, 120, 2), "idle0"))  # alone, its share is the whole budget
        wait_until(lambda: p.stats().buffered_bytes > (1 << 20) - (64 << 10))  # no room for one more entry
        p.push(schedule(range(8), "wanted", ns=other))
        done = []
        consumer = threading.Thread(target=lambda: done.append(consume(p.attach(other, "wanted", 0))), daemon=True)
        consumer.start()
        consumer.join(30)
        assert done, "the Fetch waited for budget held by schedules nobody fetches"
        assert [sid for _, sid, _ in done[0]] == list(range(8))
        check_invariants(p)
        got = consume(p.attach(1, "idle0", 0))  # a cancelled read-ahead is read again when fetched
    assert [sid for _, sid, _ in got] == list(range(0, 120, 2)) and all(v is not None for *_, v in got)


def test_a_reader_waiting_for_budget_before_its_fetch_reclaims_once_fetched(store, monkeypatch):
    """The schedule's reader already waits for budget (pushed, no consumer) when its Fetch arrives."""
    other = store.open_namespace("q").id
    store.put(other, FP, 1, [(i, 0, encode_entry(SPEC, [tensor(i)])) for i in range(8)])
    with prefetcher_of(store, prefetch_bytes=1 << 20) as p:
        p.push(schedule(range(0, 120, 2), "idle0"))
        wait_until(lambda: p.stats().buffered_bytes > (1 << 20) - (64 << 10))
        waits = threading.Event()  # set once the reader blocks for bytes (try_acquire failed)
        acquire = p.budget.acquire

        def acquire_noting_the_wanted_reader(holder, n, stop):
            if getattr(getattr(holder, "schedule", None), "schedule_id", None) == "wanted":
                waits.set()
            return acquire(holder, n, stop)

        monkeypatch.setattr(p.budget, "acquire", acquire_noting_the_wanted_reader)
        p.push(schedule(range(8), "wanted", ns=other))
        wait_until(lambda: {s.schedule_id: s.reader.state for s in p.stats().schedules}["wanted"]
                   is ReaderState.READING)
        assert waits.wait(30), "the reader never waited for budget"  # bytes nobody will release
        done = []
        consumer = threading.Thread(target=lambda: done.append(consume(p.attach(other, "wanted", 0))), daemon=True)
        consumer.start()
        consumer.join(30)
        assert done and [sid for _, sid, _ in done[0]] == list(range(8))


def test_close_during_a_push_that_is_starting_its_reader(store, monkeypatch):
    """A daemon shutting down while a Schedule call starts its reader (registered, its thread not yet
    running) closes cleanly; the late reader then finds itself cancelled."""
    starting, release = threading.Event(), threading.Event()
    original_start = threading.Thread.start

    def held_start(thread):
        if thread.name.startswith("actcache-reader-"):
            starting.set()
            release.wait(10)
        original_start(thread)

    monkeypatch.setattr(threading.Thread, "start", held_start)
    with prefetcher_of(store) as p:
        pusher = threading.Thread(target=p.push, args=(schedule(range(0, 20, 2)),))
        original_start(pusher)
        assert starting.wait(10)
        p.close()  # joins a reader whose thread has not started
        release.set()
        pusher.join(10)
        assert not pusher.is_alive()
