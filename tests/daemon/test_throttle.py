import pytest

from actcache.daemon.service._shm_fetch import Throttle


def test_an_isolated_read_waits_its_transfer_time_minus_the_burst():
    throttle = Throttle(1e6, burst_s=0.05)
    assert throttle.consume(100_000) == pytest.approx(0.05, abs=0.01)  # 0.1 s of traffic, 0.05 s of slack


def test_back_to_back_reads_are_paced_at_the_rate():
    throttle = Throttle(1e6, burst_s=0.05)
    waits = [throttle.consume(20_000) for _ in range(10)]  # 0.2 s of traffic in all
    assert waits[0] == 0.0  # within the burst
    assert sum(waits) == pytest.approx(0.2 - 0.05, abs=0.02)


def test_small_reads_within_the_burst_do_not_wait():
    throttle = Throttle(1e6, burst_s=0.05)
    assert throttle.consume(10_000) == 0.0
    assert throttle.consume(10_000) == 0.0


def test_rate_must_be_positive():
    with pytest.raises(ValueError, match="> 0"):
        Throttle(0)
