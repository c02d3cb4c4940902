"""actcache.daemon.service._job_exits: a local job's exit is noted when it happens; a reused pid is not the job."""

import os
import subprocess
import sys

from actcache.daemon.service._job_exits import JobExits, process_start_time


def test_a_watched_job_is_running_until_its_process_exits():
    exits = JobExits(clock=lambda: 123.0)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        started = process_start_time(child.pid)
        exits.watch(child.pid, started)
        assert exits.ended(child.pid, started) is None
        child.stdin.close()
        child.wait(60)
        assert exits.wait_ended(child.pid, started, 60) == 123.0
    finally:
        child.kill()
        child.wait()


def test_a_pid_that_started_at_another_time_is_another_process():
    exits = JobExits(clock=lambda: 5.0)
    me = process_start_time(os.getpid())
    exits.watch(os.getpid(), me - 3600)  # this pid, but a job that started an hour earlier
    assert exits.ended(os.getpid(), me - 3600) == 5.0
