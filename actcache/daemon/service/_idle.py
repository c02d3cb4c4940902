"""Idle timeout (``--idle-timeout``): the daemon stops once no call has been in flight for a while.

IdleMonitor is a gRPC server interceptor: a call enters when its handler
starts and leaves from its termination callback, which gRPC runs however the
call ends (reply sent, error, cancelled, client gone). A Fetch stream is in
flight for as long as it streams; so are Put and Schedule uploads. A health
check is a call like any other, so a client keeps the daemon up by calling it
more often than the timeout (the client's node-daemon lease does). Schedules
pushed and never fetched do not keep it up: a trainer that pushed one and died
would otherwise pin the daemon forever.

One thread waits on a condition, never polling: while calls are in flight it
sleeps until the last one leaves (woken by it); otherwise until ``timeout_s``
after the last call left, and then checks again, as a call may have come and
gone meanwhile. When the time is up it calls ``on_idle`` once; the daemon then
stops on the same path as SIGTERM.

Invariants: ``in_flight >= 0``; ``on_idle`` runs at most once; once it is
decided (``idle``), no call enters: each is answered UNAVAILABLE, so nothing
starts between the decision and the drain, and a client's health check sees a
daemon that is going away rather than one about to vanish under it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from actcache.daemon.service._guard import rewrap
from actcache.errors import ConfigError

__all__ = ["IdleMonitor"]

log = logging.getLogger(__name__)


class IdleMonitor(grpc.ServerInterceptor):
    """Counts calls in flight and calls ``on_idle`` once none was for ``timeout_s`` seconds."""

    def __init__(self, timeout_s: float, on_idle: Callable[[], None]) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}; pass --idle-timeout SECONDS > 0")
        self.timeout_s = timeout_s
        self._on_idle = on_idle
        self._cond = threading.Condition()
        self._in_flight = 0
        self._last = time.monotonic()  # when the last call left (or the monitor was made)
        self._waiting_for_zero = False  # the thread sleeps until in_flight drops to 0
        self._closed = False
        self.idle = False
        self._thread = threading.Thread(target=self._run, name="actcache-idle", daemon=True)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    def start(self) -> None:
        """Start counting down (from the monitor's creation, so a daemon nobody calls stops too)."""
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; ``on_idle`` is not called after this returns (it may be running now: waited for)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def enter(self) -> bool:
        """A call starts; False when the daemon decided to stop (refuse the call)."""
        with self._cond:
            if self.idle:
                return False
            self._in_flight += 1
            return True

    def leave(self) -> None:
        """A call that entered ended."""
        with self._cond:
            self._in_flight -= 1
            self._last = time.monotonic()
            if self._in_flight == 0 and self._waiting_for_zero:
                self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._in_flight:
                    self._waiting_for_zero = True
                    self._cond.wait()
                    self._waiting_for_zero = False
                    continue
                remaining = self._last + self.timeout_s - time.monotonic()
                if remaining <= 0:
                    self.idle = True
                    break
                self._cond.wait(remaining)
        if self.idle:
            log.info("no call for %g s (--idle-timeout): stopping", self.timeout_s)
            self._on_idle()

    # ---- grpc.ServerInterceptor -------------------------------------------

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return rewrap(handler, self._counted)

    def _counted(self, behavior: Callable) -> Callable:
        def counted(request, context):
            if not self.enter():
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"the daemon is stopping after {self.timeout_s:g} s without calls (--idle-timeout); "
                              "connect again to start or reach a new one")
            if not context.add_callback(self.leave):  # the call already ended
                self.leave()
            return behavior(request, context)

        return counted
