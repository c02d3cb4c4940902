"""``connect()``: which daemon a training process uses, and the daemons it starts.

While a connection to the node daemon (actcache.node) is open, a lease thread checks its health every third of
the idle timeout (at most every 60 s): the check is a call, so the daemon does not stop under a trainer that
has not needed the cache for a while, and a daemon that died is started again.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable

from actcache.errors import ConfigError, DaemonUnavailable
from actcache.node import NodeDaemon, ensure_running, healthy, peer_pid
from actcache.shm import pid_alive
from actcache_client.transport._connection import Connection, ConnectionConfig

__all__ = ["EmbeddedDaemon", "NodeDaemonLease", "connect"]

log = logging.getLogger("actcache_client")


#: Embedded daemons' temp dirs are named ``EMBEDDED_PREFIX<trainer pid>-<random>``.
EMBEDDED_PREFIX = "actcache-embedded-"


def remove_orphaned_embedded_dirs(root: Path) -> list[Path]:
    """Remove the temp dirs under ``root`` of embedded daemons whose trainer and daemon are both gone (a
    trainer killed by SIGKILL runs no exit handler); return them."""
    removed = []
    for leftover in root.glob(f"{EMBEDDED_PREFIX}*"):
        trainer = leftover.name[len(EMBEDDED_PREFIX):].split("-", 1)[0]
        if not trainer.isdigit() or pid_alive(int(trainer)) or _serving(leftover / "daemon.sock"):
            continue
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover)
    return removed


def _serving(socket: Path) -> bool:
    try:
        return peer_pid(socket) is not None
    except (OSError, ConfigError):  # not a socket, or another user's: leave the directory alone
        return True


class EmbeddedDaemon:
    """A daemon subprocess private to this process, in a temp dir removed at exit (or by the next embedded
    daemon's start, after a SIGKILL)."""

    def __init__(self) -> None:
        from actcache.testing import DaemonProcess

        for leftover in remove_orphaned_embedded_dirs(Path(tempfile.gettempdir())):
            log.info("actcache: removed %s, left by a killed trainer's embedded daemon", leftover)
        self._tmp = tempfile.TemporaryDirectory(prefix=f"{EMBEDDED_PREFIX}{os.getpid()}-")
        tmp = Path(self._tmp.name)
        self.process = DaemonProcess(tmp / "cache", tmp / "daemon.sock", ["--parent-pid", str(os.getpid())])
        self.process.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.process.proc is not None:
            self.process.stop()
        self._tmp.cleanup()


class NodeDaemonLease:
    """Keeps the node daemon up while a connection uses it (module docstring); ``stop`` ends it.

    ``revive()`` (a connection found the daemon gone) checks at once instead of at the next interval. A daemon
    found gone is started again: a warning when it is found gone, ``on_back()`` once it serves again, then
    an info line. After a failed start it tries again after 1 s (after the interval when ``connect`` could
    not start it: ``failed``), doubling up to 15 minutes; a ``revive`` does not cut that wait short."""

    def __init__(self, node: NodeDaemon, on_back: Callable[[], None] | None = None, *, failed: bool = False) -> None:
        self.node = node
        self.on_back = on_back
        idle = node.idle_timeout_s
        self.interval_s = max(0.1, min(60.0, idle / 3)) if idle else 60.0
        self._stopped = threading.Event()
        self._wake = threading.Event()
        # 0: the last check found the daemon serving (or started it); else the wait after a failed start
        self._retry_s = self.interval_s if failed else 0.0
        self._thread = threading.Thread(target=self._run, name="actcache-node-lease", daemon=True)
        self._thread.start()

    def revive(self) -> None:
        """The daemon did not answer: check (and start it again) now, unless a failed start is being waited out."""
        if not self._retry_s:
            self._wake.set()

    def _run(self) -> None:
        wait = self._retry_s or self.interval_s
        while True:
            self._wake.wait(wait)
            self._wake.clear()
            if self._stopped.is_set():
                return
            wait = self.interval_s if self._check() else self._retry_s

    def _check(self) -> bool:
        """Whether the daemon serves, started again if it was gone."""
        if healthy(self.node.target):
            return True
        if not self._retry_s:
            log.warning("actcache: the node daemon on %s is gone; starting it again (the cache is not used "
                        "meanwhile)", self.node.socket)
        try:
            ensure_running(self.node)
        except DaemonUnavailable as exc:
            if not self._retry_s:
                log.warning("actcache: the node daemon is not running and could not be started: %s", exc)
            self._retry_s = min(max(1.0, self._retry_s * 2), 900.0)
            return False
        self._retry_s = 0.0
        if self.on_back is not None:
            self.on_back()
        log.info("actcache: the node daemon is back on %s; the cache serves again", self.node.socket)
        return True

    def stop(self) -> None:
        """End the lease (does not wait for a check in progress); the daemon stops once idle."""
        self._stopped.set()
        self._wake.set()


def connect(socket: str | os.PathLike | None = None, *, address: str | None = None, embedded: bool = False,
            namespace: str = "default", secret: str | None = None, token: str | None = None, strict: bool = False,
            **options) -> Connection:
    """Connect to ``socket``, ``address``, ``$ACTCACHE_SOCKET``, or this node's daemon, started if needed.

    ``embedded=True``: a private daemon in a temp dir, stopped when the connection closes or the process
    exits (kill -9 included).
    When the node daemon cannot be started, training goes on without the cache (a CacheFallbackWarning, as
    when a daemon goes away) and the lease tries again later; ``strict=True`` raises DaemonUnavailable
    instead. A malformed ``$ACTCACHE_IDLE_TIMEOUT`` is a ConfigError. ``options`` are ConnectionConfig fields.
    """
    if embedded and (socket is not None or address is not None):
        raise ConfigError("connect(embedded=True) starts a daemon of its own; pass no socket or address with it")
    node = None
    if not embedded and socket is None and address is None and not os.environ.get("ACTCACHE_SOCKET"):
        node = NodeDaemon.from_env()
        socket = node.socket
    config = ConnectionConfig(socket=os.fspath(socket) if socket is not None else None, address=address,
                              namespace=namespace, secret=secret, token=token or os.environ.get("ACTCACHE_TOKEN"),
                              strict=strict, **options)
    if embedded:
        daemon = EmbeddedDaemon()
        return Connection(dataclasses.replace(config, socket=str(daemon.process.socket)), embedded=daemon)
    if node is None:
        return Connection(config)
    try:
        ensure_running(node)
    except DaemonUnavailable as exc:
        if strict:
            raise
        connection = _leased(config, node, failed=True)
        connection.fallback(exc)  # training goes on without the cache; the lease tries again
        return connection
    return _leased(config, node)


def _leased(config: ConnectionConfig, node: NodeDaemon, *, failed: bool = False) -> Connection:
    """A connection holding a lease on the node daemon: the lease starts the daemon again when the connection
    finds it gone, and the connection uses it again as soon as it is back."""
    lease = NodeDaemonLease(node, failed=failed)
    connection = Connection(config, embedded=lease)
    lease.on_back = connection.resume
    return connection
