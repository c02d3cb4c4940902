"""FramePump: a streaming call's messages received ahead by a thread, in order, errors where they happened."""

import itertools
import threading
import time

import pytest

from actcache.frame_pump import FramePump
from actcache.testing import wait_until


def test_messages_come_in_order_and_the_stream_ends():
    assert list(FramePump(iter(range(50)), depth=3)) == list(range(50))


def test_it_reads_at_most_depth_messages_ahead():
    produced = []

    def source():
        for i in itertools.count():
            produced.append(i)
            yield i

    pump = FramePump(source(), depth=3)
    try:
        assert next(pump) == 0
        wait_until(lambda: len(produced) == 5, timeout=5, what="the pump filling its queue")
        time.sleep(0.2)
        assert len(produced) == 5  # 1 taken, 3 queued, 1 waiting for room
        assert [next(pump) for _ in range(4)] == [1, 2, 3, 4]
    finally:
        pump.close()


def test_an_error_is_raised_where_the_stream_ended():
    def source():
        yield "a"
        yield "b"
        raise ConnectionError("daemon gone")

    pump = FramePump(source())
    assert next(pump) == "a" and next(pump) == "b"
    with pytest.raises(ConnectionError, match="daemon gone"):
        next(pump)
    with pytest.raises(StopIteration):
        next(pump)


def test_close_ends_a_thread_blocked_on_a_full_queue():
    pump = FramePump(itertools.count(), depth=2)
    wait_until(lambda: pump._queue.full(), timeout=5, what="a full queue")
    pump.close()
    pump._thread.join(timeout=5)
    assert not pump._thread.is_alive()
    with pytest.raises(StopIteration):
        next(pump)


def test_the_consumer_thread_never_runs_the_source():
    threads = set()

    def source():
        for i in range(5):
            threads.add(threading.get_ident())
            yield i

    assert list(FramePump(source())) == list(range(5))
    assert threading.get_ident() not in threads
