import time

import pytest

from actcache.daemon.service._shm_fetch import Throttle


def test_an_isolated_read_waits_its_transfer_time_minus_the_burst():
    start = time.monotonic()
    throttle = Throttle(1e6, burst_s=0.05)
    wait = throttle.consume(100_000)  # 0.1 s of traffic, 0.05 s of slack
    assert 0 <= wait <= 0.05 + 1e-3  # less when the call came late
    assert time.monotonic() - start >= 0.05 - 1e-3


def test_back_to_back_reads_are_paced_at_the_rate():
    throttle = Throttle(1e6, burst_s=0.05)
    start = time.monotonic()
    waits = [throttle.consume(20_000) for _ in range(10)]  # 0.2 s of traffic in all
    elapsed = time.monotonic() - start
    assert waits[0] == 0.0  # within the burst
    # Bounds that hold on a loaded machine: a late caller waits less, never more, and the
    # traffic never goes faster than the rate allows after the burst.
    assert sum(waits) <= 0.2 - 0.05 + 0.01
    assert elapsed >= 0.2 - 0.05 - 0.001


def test_small_reads_within_the_burst_do_not_wait():
    throttle = Throttle(1e6, burst_s=0.05)
    assert throttle.consume(10_000) == 0.0
    assert throttle.consume(10_000) == 0.0


def test_rate_must_be_positive():
    with pytest.raises(ValueError, match="> 0"):
        Throttle(0)
