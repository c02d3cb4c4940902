"""actcache.testing.wait_until: the one polling helper of the tests."""

import threading

import pytest

from actcache.testing import wait_until


def test_wait_until_returns_once_another_thread_makes_it_true():
    done = threading.Event()
    timer = threading.Timer(0.05, done.set)
    timer.start()
    try:
        wait_until(done.is_set, timeout=10, what="the timer")
    finally:
        timer.cancel()
    assert done.is_set()


def test_wait_until_names_what_it_waited_for():
    with pytest.raises(AssertionError, match=r"the daemon's counter not reached within 0.05 s"):
        wait_until(lambda: False, timeout=0.05, what="the daemon's counter")
