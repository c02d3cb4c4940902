"""The store: one LMDB environment per cache directory.

``Store`` (namespaces and secrets, reads, budgets, writes through one writer thread), explicit reads
of values from ``data.mdb`` (``ReadSession``), the lock that makes a directory one daemon's, and the
generations a put may reclaim. The daemon's bottom layer: it imports nothing from ``prefetch`` or ``service``.
"""

from actcache.daemon.store._dirlock import LOCK_NAME, DirLock, holder_pid
from actcache.daemon.store._extents import ExtentHints, PageCacheGuess, ReadSession, ValueFile
from actcache.daemon.store._store import GroupUsage, NamespaceInfo, PutResult, Store

__all__ = ["DirLock", "ExtentHints", "GroupUsage", "LOCK_NAME", "NamespaceInfo", "PageCacheGuess", "PutResult",
           "ReadSession", "Store", "ValueFile", "holder_pid"]
