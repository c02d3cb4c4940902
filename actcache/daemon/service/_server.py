"""The daemon process: binds the socket, serves the ActCache and health services, drains on SIGTERM.

Lifecycle (DaemonState): STARTING -> SERVING -> DRAINING -> STOPPED.
SERVING once the socket is bound (mode 0600, or ``--socket-mode`` for ``--socket-group``)
and health reports SERVING; TCP is loopback only unless ``--allow-remote``, token-checked,
TLS with ``--tls-cert/--tls-key``. DRAINING refuses new calls, lets in-flight ones finish
(``grace_s``; Fetch streams end at once), commits queued writes and closes LMDB.
SIGTERM, SIGINT and ``--idle-timeout`` all lead there on the same path.
"""

from __future__ import annotations

import enum
import errno
import faulthandler
import hmac
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from actcache.daemon.config import DaemonConfig, ServerConfig, is_loopback, socket_gid
from actcache.daemon.prefetch import Prefetcher
from actcache.daemon.service._guard import RequestGuard, rewrap
from actcache.daemon.service._idle import IdleMonitor
from actcache.daemon.service._service import ActCacheService
from actcache.daemon.service._shm_fetch import Throttle
from actcache.daemon.store import Store
from actcache.errors import ConfigError
from actcache.malloc import tune_malloc
from actcache.rpc import SERVICE
from actcache.shm import remove_stale

if TYPE_CHECKING:
    from actcache.daemon.service._metrics import MetricsEndpoint

__all__ = ["Daemon", "DaemonState", "serve"]

log = logging.getLogger("actcache.daemon")
# How long a thread waiting for the interpreter lock lets the one holding it run (Python's default: 5 ms):
# a call's handler (a Schedule, a Fetch's next frame) otherwise waits that long behind a stream copying entries.
_SWITCH_INTERVAL_S = 0.0005


class DaemonState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class _TokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` (constant-time compare); health is open."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return handler
        return rewrap(handler, lambda _: _deny)


def _deny(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token; pass the daemon's token (ACTCACHE_TOKEN)")


def _claim_socket(path: Path, gid: int | None) -> None:
    """Create the socket's directory (0700, or 2710 of the group sharing the socket: it may reach the
    socket, not list or add files) and remove a stale socket; refuse if a daemon answers."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if gid is not None:
            os.chown(path.parent, -1, gid)
            os.chmod(path.parent, 0o2710)
    elif gid is not None:
        st = path.parent.stat()
        if not (st.st_mode & 0o010 and st.st_gid == gid or st.st_mode & 0o001):
            log.warning("the socket is shared with gid %d but its directory %s does not let that group in "
                        "(mode %o, gid %d); see README, Access control", gid, path.parent, st.st_mode & 0o7777, st.st_gid)
    if not path.exists():
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
                raise
            path.unlink(missing_ok=True)
            log.info("removed stale socket %s", path)
            return
    raise ConfigError(f"another daemon is already serving on {path}; stop it or pass --socket PATH")


def _tls_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    if cfg.tls_cert is None or cfg.tls_key is None:
        if cfg.listen and not is_loopback(cfg.listen.rsplit(":", 1)[0]):
            log.warning("listening on %s without TLS: the token and all data cross the network in clear; "
                        "pass --tls-cert/--tls-key", cfg.listen)
        return None
    pair = []
    for what, path in (("key", cfg.tls_key), ("certificate", cfg.tls_cert)):
        try:
            pair.append(path.read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read the TLS {what} {path}: {exc.strerror}") from exc
    return grpc.ssl_server_credentials([(pair[0], pair[1])])


class Daemon:
    """One actcache daemon: a Store behind a gRPC server. ``on_idle`` is called (from the idle monitor's
    thread) once ``idle_timeout_s`` passed without a call; it should make the owner call :meth:`stop`."""

    def __init__(self, config: DaemonConfig, *, on_idle: Callable[[], None] | None = None) -> None:
        self.config = config
        self._on_idle = on_idle
        self.idle: IdleMonitor | None = None
        self.state = DaemonState.STARTING
        self.store: Store | None = None
        self.prefetcher: Prefetcher | None = None
        self.service: ActCacheService | None = None
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self.port: int | None = None
        self._owns_socket = False  # only a daemon that bound the socket may remove it
        self.metrics: MetricsEndpoint | None = None  # when --metrics-port is given

    def start(self) -> None:
        cfg = self.config.server
        self.store = Store(self.config.store)
        throttle = Throttle(cfg.throttle_read_mbps * 1e6) if cfg.throttle_read_mbps else None
        self.prefetcher = Prefetcher(self.store, self.config.prefetch)
        for path in remove_stale():  # shared-memory segments of a killed daemon
            log.info("removed stale shared-memory segment %s", path)
        service = self.service = ActCacheService(
            self.store, self.prefetcher, max_message_bytes=cfg.max_message_bytes, throttle=throttle
        )
        if cfg.idle_timeout_s and self._on_idle is not None:
            self.idle = IdleMonitor(cfg.idle_timeout_s, self._on_idle)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="actcache-rpc"),
            handlers=[service.handler()],
            # The token check runs first; the guard makes unparsable requests INVALID_ARGUMENT; the idle
            # monitor counts the calls that passed both (health checks included).
            interceptors=([_TokenInterceptor(cfg.token)] if cfg.token else []) + [RequestGuard(SERVICE)]
            + ([self.idle] if self.idle else []),
            options=[
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=cfg.workers * 8,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        gid = socket_gid(cfg.socket_group) if cfg.socket_group else None
        if cfg.socket is not None:
            _claim_socket(cfg.socket, gid)
            self._bind(self._server, f"unix:{cfg.socket}")
            self._owns_socket = True
        if cfg.listen:
            self.port = self._bind(self._server, cfg.listen, _tls_credentials(cfg))
        if self.config.metrics.port is not None:
            from actcache.daemon.service._metrics import DaemonCollector, MetricsEndpoint, daemon_families

            self.metrics = MetricsEndpoint(self.config.metrics, DaemonCollector(daemon_families(self.store, service)))
        self._server.start()
        if cfg.socket is not None:
            os.chmod(cfg.socket, cfg.socket_mode)
            if gid is not None:
                os.chown(cfg.socket, -1, gid)
        where = [f"unix:{cfg.socket}"] if cfg.socket else []
        tls = " with TLS" if cfg.tls_cert else ""
        where += [f"tcp:{cfg.listen} (port {self.port}){tls}"] if cfg.listen else []
        where += [f"metrics {self.metrics.url}"] if self.metrics else []
        # Logged before health turns SERVING, so whoever waited on health can read the addresses.
        log.info("actcache daemon serving %s on %s (pid %d)", self.config.store.dir, ", ".join(where), os.getpid())
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.state = DaemonState.SERVING
        if self.idle is not None:
            self.idle.start()

    def _bind(self, server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
        try:
            port = (server.add_secure_port(address, credentials) if credentials is not None
                    else server.add_insecure_port(address))
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {address}: {exc}") from exc
        if port == 0:
            raise ConfigError(f"cannot listen on {address}; is the address in use?")
        return port

    def stop(self) -> None:
        if self.state in (DaemonState.DRAINING, DaemonState.STOPPED):
            return
        self.state = DaemonState.DRAINING
        if self.idle is not None:
            self.idle.close()
        self._health.enter_graceful_shutdown()
        if self.prefetcher is not None:  # ends Fetch streams now instead of after the grace period
            self.prefetcher.close()
        if self._server is not None:
            self._server.stop(self.config.server.grace_s).wait()
        if self.service is not None:
            self.service.rings.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self.store is not None:
            self.store.close()
        if self._owns_socket and self.config.server.socket is not None:
            self.config.server.socket.unlink(missing_ok=True)
        self.state = DaemonState.STOPPED
        log.info("actcache daemon stopped")


#: Written to the wakeup pipe to stop by the idle monitor and the parent watch (no signal has the number 0).
_IDLE = 0


def serve(config: DaemonConfig) -> int:
    """Run a daemon until SIGTERM, SIGINT, ``--idle-timeout`` or ``--parent-pid``'s exit; returns the exit code."""
    tune_malloc()
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    # A Python handler runs only when the main thread next executes bytecode, and could be slept through
    # in Event.wait(); the C-level handler writes the signal's number to the wakeup fd from any thread,
    # so the main thread waits on that pipe (the idle monitor writes _IDLE to it).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def wake_on_idle() -> None:
        os.write(wake_w, bytes([_IDLE]))

    daemon = Daemon(config, on_idle=wake_on_idle)
    signal.set_wakeup_fd(wake_w)
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    for sig in stop_signals:  # a Python handler (doing nothing) keeps the C handler installed
        signal.signal(sig, lambda *_: None)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung daemon says where: every stack to stderr
    log.info("effective config: %s", config.non_defaults())
    try:
        daemon.start()
        if config.server.parent_pid is not None:
            threading.Thread(target=_stop_after_parent, args=(config.server.parent_pid, wake_w),
                             name="actcache-parent-watch", daemon=True).start()
        received: set[int] = set()
        while not (stop_signals | {_IDLE}) & received:  # other signals' numbers (SIGCHLD, say) only loop again
            received = set(os.read(wake_r, 64))
    finally:
        signal.set_wakeup_fd(-1)
        daemon.stop()
        os.close(wake_r)
        os.close(wake_w)
    return 0


def _stop_after_parent(pid: int, wake_w: int) -> None:
    """Wake ``serve`` to stop once ``pid`` is no longer this process's parent: a parent killed with
    SIGKILL runs no exit handler to stop the daemon it started."""
    while os.getppid() == pid:
        time.sleep(0.5)
    log.warning("parent process %d has exited (--parent-pid): stopping", pid)
    os.write(wake_w, bytes([_IDLE]))
