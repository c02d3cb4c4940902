"""What the store answers with: a namespace, a cache group's usage, a put's result."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GroupUsage", "NamespaceInfo", "PutResult"]


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    id: int
    name: str
    #: What requests name the namespace by: ``id`` when it has no secret, else a
    #: random 64-bit handle for this daemon run (set by ``open_namespace`` only).
    handle: int | None = None


@dataclass(frozen=True, slots=True)
class GroupUsage:
    namespace_id: int
    fingerprint: bytes
    depth: int
    entries: int
    bytes: int


@dataclass(frozen=True, slots=True)
class PutResult:
    entries: int
    stored_bytes: int
    replaced: int
