"""The daemon process: binds the socket, serves the ActCache and health services, drains on SIGTERM.

Lifecycle (DaemonState): STARTING -> SERVING -> DRAINING -> STOPPED.
SERVING starts once the socket is bound, restricted to its owner (0600) and
the health service reports SERVING. DRAINING refuses new calls, lets
in-flight ones finish (``grace_s``; Fetch streams end at once with UNAVAILABLE),
commits queued writes and closes LMDB.
"""

from __future__ import annotations

import enum
import errno
import hmac
import logging
import os
import signal
import socket
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from actcache.daemon.config import DaemonConfig
from actcache.daemon.prefetch import Prefetcher
from actcache.daemon.service import ActCacheService
from actcache.daemon.store import Store
from actcache.errors import ConfigError
from actcache.malloc import tune_malloc
from actcache.rpc import SERVICE

__all__ = ["Daemon", "DaemonState", "serve"]

log = logging.getLogger("actcache.daemon")


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
        return _denying_handler(handler)


def _denying_handler(like: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token; pass the daemon's token (ACTCACHE_TOKEN)")

    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(like.request_streaming, like.response_streaming)]
    return factory(deny, like.request_deserializer, like.response_serializer)


def _claim_socket(path: Path) -> None:
    """Create the socket's directory (0700) and remove a stale socket; refuse if a daemon answers."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            raise
        path.unlink(missing_ok=True)
        log.info("removed stale socket %s", path)
        return
    finally:
        probe.close()
    raise ConfigError(f"another daemon is already serving on {path}; stop it or pass --socket PATH")


class Daemon:
    """One actcache daemon: a Store behind a gRPC server."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.state = DaemonState.STARTING
        self.store: Store | None = None
        self.prefetcher: Prefetcher | None = None
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self.port: int | None = None

    def start(self) -> None:
        cfg = self.config.server
        self.store = Store(self.config.store)
        self.prefetcher = Prefetcher(self.store, self.config.prefetch)
        service = ActCacheService(self.store, self.prefetcher, max_message_bytes=cfg.max_message_bytes)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="actcache-rpc"),
            handlers=[service.handler()],
            interceptors=[_TokenInterceptor(cfg.token)] if cfg.token else [],
            options=[
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=cfg.workers * 8,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        if cfg.socket is not None:
            _claim_socket(cfg.socket)
            self._bind(f"unix:{cfg.socket}")
        if cfg.listen:
            self.port = self._bind(cfg.listen)
        self._server.start()
        if cfg.socket is not None:
            os.chmod(cfg.socket, 0o600)
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.state = DaemonState.SERVING
        where = [f"unix:{cfg.socket}"] if cfg.socket else []
        where += [f"tcp:{cfg.listen} (port {self.port})"] if cfg.listen else []
        log.info("actcache daemon serving %s on %s (pid %d)", self.config.store.dir, ", ".join(where), os.getpid())

    def _bind(self, address: str) -> int:
        try:
            port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {address}: {exc}") from exc
        if port == 0:
            raise ConfigError(f"cannot listen on {address}; is the address in use?")
        return port

    def stop(self) -> None:
        if self.state in (DaemonState.DRAINING, DaemonState.STOPPED):
            return
        self.state = DaemonState.DRAINING
        self._health.enter_graceful_shutdown()
        if self.prefetcher is not None:  # ends Fetch streams now instead of after the grace period
            self.prefetcher.close()
        if self._server is not None:
            self._server.stop(self.config.server.grace_s).wait()
        if self.store is not None:
            self.store.close()
        if self.config.server.socket is not None:
            self.config.server.socket.unlink(missing_ok=True)
        self.state = DaemonState.STOPPED
        log.info("actcache daemon stopped")


def serve(config: DaemonConfig) -> int:
    """Run a daemon until SIGTERM or SIGINT; returns the process exit code."""
    tune_malloc()
    daemon = Daemon(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("effective config: %s", config.non_defaults())
    try:
        daemon.start()
        stop.wait()
    finally:
        daemon.stop()
    return 0
