"""Namespace secrets and handles: who may read and write a namespace.

A namespace created with a secret keeps only a salted scrypt hash of it in LMDB (``hash_secret``);
every later Open must present the same secret (``verify_secret``, constant time), else
PERMISSION_DENIED. Such an Open returns a *handle*: a random 64-bit value above every namespace id,
drawn once per daemon run (``Handles``); requests name the namespace by it, and its small id (shown
in Stats) is refused. After a restart old handles are unknown (NOT_FOUND) and the client opens again.
Namespaces without a secret keep their id as the handle. Per request this costs one dict lookup;
scrypt is paid once per Open (its cost: docs/operating/access.md), which also slows guessing secrets.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading

from actcache.errors import InvalidRequest
from actcache.keys import MAX_NAMESPACE_ID

__all__ = ["Handles", "MAX_SECRET_BYTES", "check_secret", "hash_secret", "verify_secret"]

MAX_SECRET_BYTES = 1024
_N, _R, _P, _LEN = 1 << 14, 8, 1, 32


def check_secret(secret: bytes | None) -> bytes | None:
    """Return the secret, None for "no secret" (empty), or raise InvalidRequest if too long."""
    if not secret:
        return None
    if len(secret) > MAX_SECRET_BYTES:
        raise InvalidRequest(f"namespace secret is {len(secret)} bytes; at most {MAX_SECRET_BYTES}")
    return bytes(secret)


def hash_secret(secret: bytes) -> bytes:
    """A salted scrypt record of ``secret``: ``scrypt$N$r$p$salt$hash`` (hex)."""
    salt = os.urandom(16)
    digest = hashlib.scrypt(secret, salt=salt, n=_N, r=_R, p=_P, dklen=_LEN)
    return f"scrypt${_N}${_R}${_P}${salt.hex()}${digest.hex()}".encode()


def verify_secret(secret: bytes, record: bytes) -> bool:
    """Whether ``secret`` matches a ``hash_secret`` record (constant-time comparison)."""
    try:
        kind, n, r, p, salt, digest = record.decode().split("$")
        if kind != "scrypt":
            return False
        got = hashlib.scrypt(secret, salt=bytes.fromhex(salt), n=int(n), r=int(r), p=int(p), dklen=len(digest) // 2)
    except (ValueError, UnicodeDecodeError):
        return False
    return hmac.compare_digest(got, bytes.fromhex(digest))


class Handles:
    """Random 64-bit handles of protected namespaces, one per namespace per daemon run (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_handle: dict[int, int] = {}
        self._by_namespace: dict[int, int] = {}

    def issue(self, namespace_id: int) -> int:
        with self._lock:
            handle = self._by_namespace.get(namespace_id)
            while handle is None or handle in self._by_handle and self._by_handle[handle] != namespace_id:
                handle = MAX_NAMESPACE_ID + 1 + secrets.randbelow(2**64 - MAX_NAMESPACE_ID - 1)
            self._by_handle[handle] = namespace_id
            self._by_namespace[namespace_id] = handle
            return handle

    def namespace_of(self, handle: int) -> int | None:
        with self._lock:
            return self._by_handle.get(handle)
