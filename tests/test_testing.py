"""actcache.testing: wait_until, the one polling helper of the tests, and run_daemon's cleanup."""

import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
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


_STOPPED_BY_KILL = r"""
import time
from actcache.testing import run_daemon
with run_daemon() as daemon:
    print(daemon.pid, flush=True)
    for _ in range(1200):  # a main thread that runs bytecode, as a training loop does: a Python signal
        time.sleep(0.05)   # handler runs there, also when the kernel gave the signal to another thread
"""


@pytest.mark.slow
def test_a_process_stopped_with_sigterm_stops_its_daemon_too():
    """A benchmark ended with ``kill`` (SIGTERM) used to leave its daemon running: run_daemon's cleanup
    was skipped. Now the daemon is stopped first, and the process still dies of SIGTERM."""
    root = Path(__file__).resolve().parents[1]
    with subprocess.Popen([sys.executable, "-c", _STOPPED_BY_KILL], cwd=root, stdout=subprocess.PIPE, text=True) as proc:
        try:
            daemon_pid = int(proc.stdout.readline())
            assert psutil.pid_exists(daemon_pid)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == -signal.SIGTERM
            assert not psutil.pid_exists(daemon_pid)
        finally:
            proc.kill()


def test_a_failure_inside_run_daemon_keeps_the_daemons_log_on_stderr(capsys):
    from actcache.testing import run_daemon

    with pytest.raises(RuntimeError, match="the test failed"):
        with run_daemon() as daemon:
            log_path = daemon.log_path
            raise RuntimeError("the test failed")
    assert not log_path.exists()  # removed with the temp dir
    err = capsys.readouterr().err
    assert "the daemon's log when the code using it failed" in err and "serving" in err
