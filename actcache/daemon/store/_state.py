"""The state a store's reads and its write operations (``_ops``) share: the environment, its tables
and the in-memory maps of namespaces, secrets and usage; and what the store answers with.

Invariant: the maps change only under ``lock``, and the writer changes them only after its
transaction committed (an op's ``publish``), so they always equal the committed tables.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import lmdb

if TYPE_CHECKING:
    from lmdb import _Database  # the stubs' name for an open named table (lmdb.open_db's result)

from actcache.daemon.store._generations import Generations, read_write_time
from actcache.keys import namespace_id_of

__all__ = ["GroupUsage", "NAMESPACE_ID", "NamespaceInfo", "PutResult", "StoreState", "USAGE"]

#: A ``groups`` table value: entries u64, bytes u64.
USAGE = struct.Struct(">QQ")
#: A ``namespaces`` table value, and ``meta``'s next namespace id: u32.
NAMESPACE_ID = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    id: int
    name: str
    #: What requests name it by: ``id`` without a secret, else a random handle (set by ``open_namespace``).
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


@dataclass(eq=False)
class StoreState:
    """One store's environment, its named tables (``actcache.daemon.store._store`` lists them) and
    what is kept of them in memory."""

    env: lmdb.Environment
    entries: _Database
    namespaces: _Database
    groups: _Database
    meta: _Database
    secrets: _Database
    generation_times: _Database
    #: Last write, last read and live schedules of each (namespace, fingerprint).
    generations: Generations
    #: Guards the maps below.
    lock: threading.Lock = field(default_factory=threading.Lock)
    ns_by_name: dict[str, int] = field(default_factory=dict)
    ns_by_id: dict[int, str] = field(default_factory=dict)
    #: Group prefix -> [entries, bytes].
    usage: dict[bytes, list[int]] = field(default_factory=dict)
    #: Namespace id -> scrypt record, for protected namespaces.
    secret_of: dict[int, bytes] = field(default_factory=dict)

    def load(self, txn) -> None:
        """Fill the maps from the tables (at open, before any other thread uses them)."""
        for name, value in txn.cursor(db=self.namespaces):
            ns_id = NAMESPACE_ID.unpack(value)[0]
            self.ns_by_name[name.decode()] = ns_id
            self.ns_by_id[ns_id] = name.decode()
        for prefix, value in txn.cursor(db=self.groups):
            self.usage[bytes(prefix)] = list(USAGE.unpack(value))
        for ns_key, record in txn.cursor(db=self.secrets):
            self.secret_of[namespace_id_of(ns_key)] = bytes(record)
        self.generations.load((bytes(g), read_write_time(t)) for g, t in txn.cursor(db=self.generation_times))