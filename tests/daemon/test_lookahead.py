"""Probes run ahead while data is cold and pause while it is all cached."""

from concurrent.futures import Executor, Future

from actcache.daemon.prefetch._lookahead import INLINE_PROBE_AHEAD, MIN_PROBED_ENTRY_BYTES, Prober


class Inline(Executor):
    """Runs each task at submit time, so the test decides exactly what the probes see."""

    def __init__(self) -> None:
        self.calls = 0

    def submit(self, fn, *args):
        self.calls += 1
        future = Future()
        future.set_result(fn(*args))
        return future


def test_probes_pause_when_warm_and_resume_on_a_cold_read():
    pool, cached = Inline(), {"warm": True}
    probed: list[bytes] = []

    def probe(keys, hints, start):
        probed.extend(keys)
        return [cached["warm"]] * len(keys)

    prober = Prober(pool, probe, lambda p: p.to_bytes(4, "big"), length=10_000, window_bytes=64 << 20)
    pos = 0
    while prober.active and pos < 10_000:
        prober.advance(pos, avg_bytes=1 << 20)  # window of 64 entries
        prober.saw_read(True)
        pos += 1
    assert not prober.active and pos < 400  # a streak of cached entries paused probing
    calls = pool.calls
    for _ in range(100):
        prober.advance(pos, 1 << 20)
        pos += 1
    assert pool.calls == calls  # nothing probed while paused
    cached["warm"] = False
    prober.saw_read(False)  # the reader had to wait for the disk
    prober.advance(pos, 1 << 20)
    assert prober.active and pool.calls > calls
    assert probed[-1] == (pos + 64).to_bytes(4, "big")  # the window ahead of the reader
    for _ in range(1000):
        prober.advance(pos, 1 << 20)
        pos += 1
    assert prober.active  # cold data keeps probing on


def test_small_entries_are_probed_from_the_readers_thread_each_once():
    pool, probed = Inline(), []

    def probe(keys, hints, start):
        probed.extend(int.from_bytes(k, "big") for k in keys)
        return [False] * len(keys)  # cold: probing goes on

    small = MIN_PROBED_ENTRY_BYTES // 2
    window = 128  # entries of `small` bytes in window_bytes
    prober = Prober(pool, probe, lambda p: p.to_bytes(4, "big"), length=1000, window_bytes=window * small)
    prober.advance(0, avg_bytes=0)  # nothing read yet: the entry size is unknown
    assert probed == list(range(1, 1 + INLINE_PROBE_AHEAD)) and pool.calls == 0
    for pos in range(1, 1000):
        prober.advance(pos, avg_bytes=small)
        assert probed[-1] - pos <= window  # never further ahead than the window's bytes
        if pos + window < 1000:
            assert probed[-1] - pos >= window // 2  # nor closer than half of it
    assert probed == list(range(1, 1000)) and pool.calls == 0  # each entry once, none on the pool
    prober.advance(1000, avg_bytes=MIN_PROBED_ENTRY_BYTES)
    assert pool.calls == 0  # past the end: nothing left to probe
    big = Prober(pool, probe, lambda p: p.to_bytes(4, "big"), length=1000, window_bytes=64 << 20)
    big.advance(0, avg_bytes=MIN_PROBED_ENTRY_BYTES)
    assert pool.calls > 0  # large entries: on the pool
