"""Idle timeout (``--idle-timeout``): the daemon stops once no call has been in flight for a while.

A call counts from its handler's start to its termination callback, streams while they stream; health
checks count (a client's lease keeps the daemon up), pushed schedules do not (a dead trainer would pin
it forever). Invariants: ``in_flight >= 0``; ``on_idle`` runs at most once; once ``idle`` is decided,
every new call is refused UNAVAILABLE, so nothing starts before the drain.
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
        """Stop the thread; ``on_idle`` is not called after this returns (a running one is waited for)."""
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
            if self._in_flight == 0:  # wakes the thread waiting for it
                self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._in_flight:
                    self._cond.wait()
                    continue
                remaining = self._last + self.timeout_s - time.monotonic()
                if remaining <= 0:
                    self.idle = True
                    break
                self._cond.wait(remaining)
        if self.idle:
            log.info("no call for %g s (--idle-timeout): stopping", self.timeout_s)
            self._on_idle()

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
