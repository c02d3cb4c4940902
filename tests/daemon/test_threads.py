"""ReusedThreads: a reader's loop starts at once on a thread kept from an earlier one."""

import threading
import time

from actcache.daemon.prefetch._threads import ReusedThreads
from actcache.testing import wait_until


def test_a_finished_thread_runs_the_next_function_under_its_name():
    threads = ReusedThreads("t")
    seen = []
    for i in range(3):
        done = threads.run(lambda i=i: seen.append((i, threading.current_thread().name, threading.get_ident())), f"job{i}")
        assert done.wait(5)
        wait_until(lambda: threads.idle() == 1, timeout=5, what="the thread back to idle")
    assert [(i, name) for i, name, _ in seen] == [(0, "job0"), (1, "job1"), (2, "job2")]
    assert len({ident for *_, ident in seen}) == 1 and threads.started == 1
    threads.close()


def test_functions_never_wait_behind_running_ones():
    threads = ReusedThreads("t")
    release = threading.Event()
    blocked = [threads.run(release.wait, f"blocked{i}") for i in range(4)]  # readers that run for long
    quick = threads.run(lambda: None, "quick")
    assert quick.wait(5)  # got a thread of its own at once
    assert not any(done.is_set() for done in blocked)
    assert threads.started == 5
    release.set()
    assert all(done.wait(5) for done in blocked)
    threads.close()


def test_idle_threads_end_after_idle_s_and_a_new_function_gets_a_new_thread():
    threads = ReusedThreads("t", idle_s=0.1)
    assert threads.run(lambda: None, "a").wait(5)
    wait_until(lambda: threads.idle() == 1, timeout=5, what="idle")
    time.sleep(0.3)
    assert threads.idle() == 0  # retired
    assert threads.run(lambda: None, "b").wait(5)
    assert threads.started == 2
    threads.close()


def test_close_ends_idle_threads_and_later_functions_still_run():
    threads = ReusedThreads("t")
    assert threads.run(lambda: None, "a").wait(5)
    wait_until(lambda: threads.idle() == 1, timeout=5, what="idle")
    before = {t.name for t in threading.enumerate()}
    assert "t-idle" in before
    threads.close()
    wait_until(lambda: "t-idle" not in {t.name for t in threading.enumerate()}, timeout=5, what="the idle thread ending")
    assert threads.run(lambda: None, "late").wait(5)  # e.g. a push racing the daemon's shutdown
    assert threads.idle() == 0
