"""When the jobs on the daemon's own host exit: a pidfd per job process, polled by one thread.

A job is its ``(pid, start_time)`` (JobInfo): a pid whose process started at another time is another
process, so the job had ended before it was watched. Jobs on other hosts are not watched (``local`` False).
Invariant: a key is watched by at most one fd, and once in ``_ended`` its time never changes (``ended`` may
note an exit before the thread does; the thread then only closes the fd).
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Callable

__all__ = ["JobExits", "process_start_time"]

_SAME_START_S = 1.0  # /proc's start time is in clock ticks; the job's own reading agrees to well under this


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (wall clock seconds), from /proc; None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:  # field 22 (after the parenthesised name): start in clock ticks
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


class JobExits:
    """Watches job processes of this host and remembers when each exited (wall clock, ``clock``)."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Condition()
        self._watched: dict[int, tuple[int, float]] = {}  # pidfd -> job key
        self._ended: dict[tuple[int, float], float] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread: threading.Thread | None = None

    def watch(self, pid: int, start_time: float) -> None:
        """Watch the job ``(pid, start_time)`` (a process of this host) until it exits."""
        key = (pid, start_time)
        with self._lock:
            if key in self._ended or key in self._watched.values():
                return
            try:
                fd = os.pidfd_open(pid)
            except (ProcessLookupError, PermissionError, OSError):
                self._ended[key] = self._clock()
                return
            started = process_start_time(pid)
            if started is None or (start_time and abs(started - start_time) > _SAME_START_S):
                os.close(fd)  # the pid is another process now: the job ended before it was watched
                self._ended[key] = self._clock()
                return
            self._watched[fd] = key
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="actcache-job-exits", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")

    def ended(self, pid: int, start_time: float) -> float | None:
        """When the job exited (None: running, or never watched); an exit the thread has not seen yet is
        noted now, so a job found ended by whoever reaped it is ended here too."""
        key = (pid, start_time)
        with self._lock:
            if key not in self._ended:
                fds = [fd for fd, k in self._watched.items() if k == key]
                poller = select.poll()
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                if fds and poller.poll(0):
                    self._ended[key] = self._clock()
            return self._ended.get(key)

    def wait_ended(self, pid: int, start_time: float, timeout_s: float) -> float | None:
        """``ended``, waiting up to ``timeout_s`` for it (tests)."""
        with self._lock:
            self._lock.wait_for(lambda: (pid, start_time) in self._ended, timeout_s)
            return self._ended.get((pid, start_time))

    def _run(self) -> None:
        while True:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            with self._lock:
                for fd in self._watched:
                    poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    while True:
                        try:
                            if not os.read(self._wake_r, 4096):
                                break
                        except BlockingIOError:
                            break
                    continue
                with self._lock:
                    key = self._watched.pop(fd, None)
                    if key is not None:
                        self._ended.setdefault(key, self._clock())
                        self._lock.notify_all()
                os.close(fd)
