"""The one exception tree of actcache, and its mapping to gRPC status codes.

    ActCacheError               base of everything actcache raises
    ├── ConfigError             a flag, env var or config value is invalid
    │   └── ConfigTypeError     ... of the wrong type (also a TypeError)
    ├── DaemonUnavailable       the daemon cannot be reached or timed out     UNAVAILABLE / DEADLINE_EXCEEDED
    ├── VersionMismatch         client and daemon speak different protocols   FAILED_PRECONDITION
    ├── Unauthenticated         missing or wrong token                        UNAUTHENTICATED
    ├── PermissionDenied        wrong or missing namespace secret             PERMISSION_DENIED
    ├── NamespaceNotFound       unknown namespace name or handle              NOT_FOUND
    ├── ScheduleNotFound        schedule never pushed, or served to its end   NOT_FOUND
    ├── FetchAborted            schedule pushed again, or Fetch taken over    ABORTED
    ├── InvalidRequest          malformed request or entry                    INVALID_ARGUMENT
    ├── EntryCorrupt            stored entry failed its checksum; deleted     DATA_LOSS
    ├── BudgetExceeded          a byte budget or the disk is full             RESOURCE_EXHAUSTED
    ├── StoreError              the storage engine failed unexpectedly        INTERNAL
    ├── ReferenceModelFailed    the reference-model process failed            (client only)
    ├── CacheMismatchError      an audited entry differs (strict mode)        (client only)
    ├── PolicyError             a freeze policy asked the impossible          (client only, a RuntimeError)
    └── LifecycleError          a call in a state that does not allow it      (client only, a RuntimeError)

ConfigError is also a ValueError. Every message says what was wrong and how to fix it. The daemon names
the class in the ``actcache-error`` trailing metadata: a client raises the class the daemon raised.
"""

from __future__ import annotations

import grpc

__all__ = ["ActCacheError", "BudgetExceeded", "CacheMismatchError", "ConfigError", "ConfigTypeError",
           "DaemonUnavailable", "ERROR_METADATA_KEY", "EntryCorrupt", "FetchAborted", "InvalidRequest",
           "LifecycleError", "NamespaceNotFound", "PermissionDenied", "PolicyError", "ReferenceModelFailed",
           "ScheduleNotFound", "StoreError", "Unauthenticated", "VersionMismatch", "error_from_status", "error_of",
           "status_of"]

ERROR_METADATA_KEY = "actcache-error"


class ActCacheError(Exception):
    """Base class of every error actcache raises."""

    status = grpc.StatusCode.UNKNOWN

    def __init_subclass__(cls, status: grpc.StatusCode | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status


class ConfigError(ActCacheError, ValueError, status=grpc.StatusCode.INVALID_ARGUMENT):
    """A configuration value (flag, environment variable, argument) is invalid."""


class DaemonUnavailable(ActCacheError, status=grpc.StatusCode.UNAVAILABLE):
    """The daemon is not running, not reachable, or did not answer in time."""


class VersionMismatch(ActCacheError, status=grpc.StatusCode.FAILED_PRECONDITION):
    """At ``Open``: the client and the node daemon speak different wire protocols (a daemon that
    outlived a client upgrade, or the reverse). The message names both versions and says to restart
    the node daemon."""


class Unauthenticated(ActCacheError, status=grpc.StatusCode.UNAUTHENTICATED):
    """The request carried no token or a wrong one (TCP listeners only)."""


class PermissionDenied(ActCacheError, status=grpc.StatusCode.PERMISSION_DENIED):
    """The namespace is protected: Open without its secret, a wrong secret, or a request
    naming it by its small id instead of the handle Open returned."""


class NamespaceNotFound(ActCacheError, status=grpc.StatusCode.NOT_FOUND):
    """The namespace name or handle is not known to the daemon."""


class ScheduleNotFound(ActCacheError, status=grpc.StatusCode.NOT_FOUND):
    """Fetch named a schedule that was never pushed or was served to its end (a push that fails or is
    cancelled changes nothing: the schedule it would have replaced stays as it was)."""


class FetchAborted(ActCacheError, status=grpc.StatusCode.ABORTED):
    """A Fetch stream ended early: its schedule was pushed again, or a newer Fetch of it took over."""


class InvalidRequest(ActCacheError, status=grpc.StatusCode.INVALID_ARGUMENT):
    """A request or an entry is malformed: wrong dtype, shape, length or key field."""


class EntryCorrupt(ActCacheError, status=grpc.StatusCode.DATA_LOSS):
    """A stored entry failed its checksum on read; the daemon deleted it."""


class BudgetExceeded(ActCacheError, status=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """A namespace or daemon byte budget, or the disk, is full. Reads still work."""


class StoreError(ActCacheError, status=grpc.StatusCode.INTERNAL):
    """The storage engine failed in a way the daemon did not expect."""


class ReferenceModelFailed(ActCacheError):
    """The training client's reference-model process (freeze controller) raised or died; never sent over gRPC."""


class CacheMismatchError(ActCacheError):
    """An audit recomputed a served sample and got something else: the entry was not made by this
    computation (strict mode; otherwise the client warns, drops the fingerprint and recomputes)."""


class ConfigTypeError(ConfigError, TypeError):
    """An argument of the wrong type (a ConfigError that is also a TypeError)."""


class PolicyError(ActCacheError, RuntimeError):
    """A freeze policy asked the controller for something it cannot do (freeze a stage out of order,
    unfreeze with nothing frozen). The message names the policy and its decision."""


class LifecycleError(ActCacheError, RuntimeError):
    """A method was called in a state that does not allow it: ``HostRing.alloc`` before ``acquire``,
    a worker started twice. The message names the call that should have come first."""


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code the daemon answers with for ``exc``."""
    return exc.status if isinstance(exc, ActCacheError) else grpc.StatusCode.INTERNAL


# What the daemon raises; a status alone maps to the first class listed with it.
_DAEMON_ERRORS = (
    DaemonUnavailable, VersionMismatch, Unauthenticated, PermissionDenied, NamespaceNotFound, ScheduleNotFound,
    FetchAborted, InvalidRequest, EntryCorrupt, BudgetExceeded, StoreError,
)
_BY_STATUS = {cls.status: cls for cls in reversed(_DAEMON_ERRORS)}
_BY_STATUS[grpc.StatusCode.DEADLINE_EXCEEDED] = DaemonUnavailable
_BY_NAME = {cls.__name__: cls for cls in (ActCacheError, ConfigError, *_DAEMON_ERRORS)}


def error_from_status(code: grpc.StatusCode, details: str, name: str | None = None) -> ActCacheError:
    """The client-side exception for a failed call with ``code``, ``details`` and the daemon's class ``name``."""
    cls = _BY_NAME.get(name or "")
    if cls is None or cls.status != code:
        cls = _BY_STATUS.get(code, ActCacheError)
    return cls(f"{details} [{code.name}]")


def error_of(exc: grpc.RpcError) -> ActCacheError:
    """The client-side exception for a failed call (``error_from_status`` of its status and trailing metadata)."""
    try:
        name = dict(exc.trailing_metadata() or ()).get(ERROR_METADATA_KEY)
    except Exception:  # a call that never reached the daemon has no metadata
        name = None
    return error_from_status(exc.code(), exc.details() or "", name)
