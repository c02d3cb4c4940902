"""The service: the gRPC handlers over the store and the prefetcher, and the daemon process around them.

Handlers and shared-memory Fetch (``ActCacheService``), request guards,
the read throttle, Prometheus metrics, the idle timeout, the jobs that
opened each namespace, and the server lifecycle (``serve``). The top layer.
"""

from actcache.daemon.service._server import Daemon, DaemonState, serve
from actcache.daemon.service._service import ActCacheService

__all__ = ["ActCacheService", "Daemon", "DaemonState", "serve"]
