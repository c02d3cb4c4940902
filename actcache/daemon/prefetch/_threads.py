"""Threads kept between uses, so that starting a schedule's reader costs no thread start.

Why: ``Thread.start`` returns only once the new thread has run its first
bytecode, and in the daemon that thread waits for the interpreter lock
behind the RPC, reader and decode threads. Sampled on the 2-core VM while a
client pushed 683-id schedules back to back (py-spy, wall time), 56% of the
Schedule handler's time was that wait. Handing the reader's loop to a
thread that already runs costs a queue put: with ``ScheduleSmall``, a push
of one id answers in 0.47 ms instead of 0.71-0.84, one of 20,000 ids in
2.9-3.2 ms instead of 4.5-5.7.

Unlike a ThreadPoolExecutor, ``run`` never queues a function behind others:
a reader runs until its schedule is served or dropped, so a bounded pool
could leave a new schedule unread. A function gets an idle thread, or a new
one; a thread idle for ``idle_s`` ends.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

__all__ = ["ReusedThreads"]


class ReusedThreads:
    """Runs each function on a thread of its own at once, reusing threads that finished earlier ones."""

    def __init__(self, name: str, *, idle_s: float = 60.0) -> None:
        self.name, self.idle_s = name, idle_s
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # the most recently idle last
        self._closed = False
        #: Threads started so far (a reused thread is not counted again).
        self.started = 0

    def run(self, fn: Callable[[], None], name: str) -> threading.Event:
        """Run ``fn`` now on a thread named ``name`` while it runs; the event is set once it returned
        (or raised: a reader handles its own errors, anything else is logged by ``threading.excepthook``)."""
        done = threading.Event()
        with self._lock:
            worker = self._idle.pop() if self._idle else None  # closed: none idle, a thread that then ends
            if worker is None:
                self.started += 1
        if worker is None:
            worker = _Worker(self)
            worker.thread.start()
        worker.tasks.put((fn, name, done))
        return done

    def idle(self) -> int:
        """Threads waiting for a function."""
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        """End the idle threads now; running ones, and any started later, end with their function."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.tasks.put(None)

    def _rest(self, worker: "_Worker") -> bool:
        """``worker`` finished a function: keep it for the next (False: the pool is closed, it ends)."""
        with self._lock:
            if self._closed:
                return False
            self._idle.append(worker)
            return True

    def _retire(self, worker: "_Worker") -> bool:
        """``worker`` waited ``idle_s`` for nothing: True if it may end (no ``run`` has taken it meanwhile)."""
        with self._lock:
            if worker in self._idle:
                self._idle.remove(worker)
                return True
            return False


class _Worker:
    __slots__ = ("pool", "tasks", "thread")

    def __init__(self, pool: ReusedThreads) -> None:
        self.pool = pool
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"{pool.name}-idle", daemon=True)

    def _loop(self) -> None:
        while True:
            try:
                task = self.tasks.get(timeout=self.pool.idle_s)
            except queue.Empty:
                if self.pool._retire(self):
                    return
                continue  # taken by a run() just now: its function is on the way
            if task is None:
                return
            fn, name, done = task
            self.thread.name = name
            try:
                fn()
            finally:
                self.thread.name = f"{self.pool.name}-idle"
                done.set()
            if not self.pool._rest(self):
                return
