"""actcache: activation cache daemon and the torch-free wire layer.

The error classes every part of actcache raises are public here (their tree
is drawn in ``actcache.errors``); the daemon (``actcache.daemon``) and the
wire modules (``codec``, ``keys``, ``rpc``, ``rpc_client``) are imported by name.
"""

from actcache.errors import (
    ActCacheError,
    BudgetExceeded,
    CacheMismatchError,
    ConfigError,
    ConfigTypeError,
    DaemonUnavailable,
    EntryCorrupt,
    FetchAborted,
    InvalidRequest,
    LifecycleError,
    NamespaceNotFound,
    PermissionDenied,
    PolicyError,
    ReferenceModelFailed,
    ScheduleNotFound,
    StoreError,
    Unauthenticated,
    VersionMismatch,
)

__version__ = "0.1.0"

__all__ = [
    "ActCacheError",
    "BudgetExceeded",
    "CacheMismatchError",
    "ConfigError",
    "ConfigTypeError",
    "DaemonUnavailable",
    "EntryCorrupt",
    "FetchAborted",
    "InvalidRequest",
    "LifecycleError",
    "NamespaceNotFound",
    "PermissionDenied",
    "PolicyError",
    "ReferenceModelFailed",
    "ScheduleNotFound",
    "StoreError",
    "Unauthenticated",
    "VersionMismatch",
    "__version__",
]
