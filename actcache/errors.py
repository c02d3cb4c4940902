"""The one exception tree of actcache, and its mapping to gRPC status codes.

    ActCacheError                   base of everything actcache raises
    ├── ConfigError                 a flag, env var or config value is invalid
    ├── DaemonUnavailable           the daemon cannot be reached or timed out   UNAVAILABLE / DEADLINE_EXCEEDED
    ├── Unauthenticated             missing or wrong token                      UNAUTHENTICATED
    ├── NamespaceNotFound           unknown namespace name or handle            NOT_FOUND
    ├── InvalidRequest              malformed request or entry (dtype, shape,   INVALID_ARGUMENT
    │                               length, key field out of range)
    ├── EntryCorrupt                stored entry failed its checksum; deleted   DATA_LOSS
    ├── BudgetExceeded              a byte budget or the disk is full           RESOURCE_EXHAUSTED
    ├── StoreError                  the storage engine failed unexpectedly      INTERNAL
    └── ReferenceModelFailed        the client's reference-model process        (client only)
                                    failed or exited (Egeria plasticity)

Every message says what was wrong, with values and units, and how to fix it.
"""

from __future__ import annotations

import grpc

__all__ = [
    "ActCacheError",
    "BudgetExceeded",
    "ConfigError",
    "DaemonUnavailable",
    "EntryCorrupt",
    "InvalidRequest",
    "NamespaceNotFound",
    "ReferenceModelFailed",
    "StoreError",
    "Unauthenticated",
    "error_from_status",
    "status_of",
]


class ActCacheError(Exception):
    """Base class of every error actcache raises."""

    status = grpc.StatusCode.UNKNOWN


class ConfigError(ActCacheError, ValueError):
    """A configuration value (flag, environment variable, argument) is invalid."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class DaemonUnavailable(ActCacheError):
    """The daemon is not running, not reachable, or did not answer in time."""

    status = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ActCacheError):
    """The request carried no token or a wrong one (TCP listeners only)."""

    status = grpc.StatusCode.UNAUTHENTICATED


class NamespaceNotFound(ActCacheError):
    """The namespace name or handle is not known to the daemon."""

    status = grpc.StatusCode.NOT_FOUND


class InvalidRequest(ActCacheError):
    """A request or an entry is malformed: wrong dtype, shape, length or key field."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class EntryCorrupt(ActCacheError):
    """A stored entry failed its checksum on read; the daemon deleted it."""

    status = grpc.StatusCode.DATA_LOSS


class BudgetExceeded(ActCacheError):
    """A namespace or daemon byte budget, or the disk, is full. Reads still work."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class StoreError(ActCacheError):
    """The storage engine failed in a way the daemon did not expect."""

    status = grpc.StatusCode.INTERNAL


class ReferenceModelFailed(ActCacheError):
    """The training client's reference-model process (freeze controller) raised or died; never sent over gRPC."""


_BY_STATUS: dict[grpc.StatusCode, type[ActCacheError]] = {
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DaemonUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.NOT_FOUND: NamespaceNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.DATA_LOSS: EntryCorrupt,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BudgetExceeded,
    grpc.StatusCode.INTERNAL: StoreError,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code the daemon answers with for ``exc``."""
    if isinstance(exc, ActCacheError):
        return exc.status
    return grpc.StatusCode.INTERNAL


def error_from_status(code: grpc.StatusCode, details: str) -> ActCacheError:
    """The client-side exception for a failed call with ``code`` and ``details``."""
    cls = _BY_STATUS.get(code, ActCacheError)
    return cls(f"{details} [{code.name}]")
