"""The store's write operations, applied by its writer thread inside one shared LMDB transaction.

Each operation (put, drop, reclaim, delete, create a namespace) changes
entries and the per-group usage records together, in the writer's
transaction, and publishes its effect on the store's in-memory maps only
after the transaction committed (``publish``).
"""

from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING, Iterable

from actcache.codec import verify_entry
from actcache.daemon.store._records import NamespaceInfo, PutResult
from actcache.daemon.store._generations import GEN_PREFIX_BYTES, Generation, ReclaimPlan, read_write_time, write_time
from actcache.daemon.store._writer import WriteOp
from actcache.errors import BudgetExceeded, InvalidRequest

if TYPE_CHECKING:
    from actcache.daemon.store._store import Store

__all__: list[str] = []  # internal to the store

log = logging.getLogger("actcache.daemon.store")

_GROUP_PREFIX_BYTES = 4 + 16 + 2
_USAGE = struct.Struct(">QQ")
_DROP_CHUNK_BYTES = 256 << 20
_DROP_CHUNK_ENTRIES = 100_000


class _ReclaimNeeded(BudgetExceeded):
    """A put fits once ``plan``'s dead generations are dropped (never leaves Store.put)."""

    def __init__(self, message: str, plan: ReclaimPlan) -> None:
        super().__init__(message)
        self.plan = plan


class _StoreOp(WriteOp):
    """A write operation on the store; applied by the writer inside a shared transaction."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store

    def _adjust(self, txn, pending: dict[bytes, list[int]], prefix: bytes, entries: int, nbytes: int) -> None:
        usage = pending.setdefault(prefix, list(self.store._usage.get(prefix, [0, 0])))
        usage[0] += entries
        usage[1] += nbytes
        txn.put(prefix, _USAGE.pack(*usage), db=self.store._groups)

    def publish(self, pending: dict[bytes, list[int]]) -> None:
        with self.store._lock:
            self.store._usage.update({p: list(u) for p, u in pending.items()})


class _PutOp(_StoreOp):
    def __init__(self, store: Store, prefix: bytes, records: list[tuple[bytes, bytes | memoryview]]) -> None:
        super().__init__(store)
        self.prefix = prefix
        self.records = records
        self.nbytes = sum(len(v) for _, v in records)

    def apply(self, txn, pending):
        db = self.store._entries
        added = replaced = delta = 0
        sizes: dict[bytes, int | None] = {}  # stored size of each key as this op leaves it
        cursor = txn.cursor(db=db)
        for key, value in self.records:
            if key not in sizes:
                sizes[key] = self.store._file.pages.stored_length(cursor, key)
            if sizes[key] is None:
                added += 1
                delta += len(value)
            else:
                replaced += 1
                delta += len(value) - sizes[key]
            sizes[key] = len(value)
        self.store._check_budget(self.prefix, delta, pending)
        self.store._check_disk(txn, self.nbytes)
        for key, value in self.records:
            txn.put(key, value, db=db)
        self._adjust(txn, pending, self.prefix, added, delta)
        self.written = self.store.generations.now()
        txn.put(self.prefix[:GEN_PREFIX_BYTES], write_time(self.written), db=self.store._generations)
        return PutResult(len(self.records), sum(len(v) for _, v in self.records), replaced)

    def publish(self, pending):
        super().publish(pending)
        self.store.generations.wrote(self.prefix[:GEN_PREFIX_BYTES], self.written)


class _DropOp(_StoreOp):
    """Deletes the next chunk of entries under ``prefix``; returns (entries, bytes, done)."""

    frees_pages = True

    def __init__(self, store: Store, prefix: bytes) -> None:
        super().__init__(store)
        self.prefix = prefix
        self.emptied: list[bytes] = []  # generations left without entries (their last-write rows went)

    def apply(self, txn, pending):
        self.emptied = []
        removed: dict[bytes, list[int]] = {}
        entries = nbytes = 0
        cursor = txn.cursor(db=self.store._entries)
        done = not cursor.set_range(self.prefix)
        while not done:
            key = cursor.key()
            if bytes(key[: len(self.prefix)]) != self.prefix:
                done = True
                break
            if entries >= _DROP_CHUNK_ENTRIES or nbytes >= _DROP_CHUNK_BYTES:
                break
            size = len(cursor.value())
            group = removed.setdefault(bytes(key[:_GROUP_PREFIX_BYTES]), [0, 0])
            group[0] += 1
            group[1] += size
            entries += 1
            nbytes += size
            done = not cursor.delete()
        for group, (n, b) in removed.items():
            self._adjust(txn, pending, group, -n, -b)
        if done:
            # Usage rows of the dropped groups go too (and any drift between rows and entries with them).
            for group in [p for p in set(self.store._usage) | set(pending) if p.startswith(self.prefix)]:
                usage = pending.get(group, self.store._usage.get(group, [0, 0]))
                if usage != [0, 0]:
                    log.warning("drop: usage of group %s was %s after its entries were deleted", group.hex(), usage)
                pending[group] = [0, 0]
                txn.delete(group, db=self.store._groups)
            self._forget_empty_generations(txn, pending)
        return entries, nbytes, done

    def _forget_empty_generations(self, txn, pending) -> None:
        store = self.store
        groups = set(store._usage) | set(pending)
        if len(self.prefix) >= GEN_PREFIX_BYTES:
            touched = {self.prefix[:GEN_PREFIX_BYTES]}
        else:
            touched = {p[:GEN_PREFIX_BYTES] for p in groups if p.startswith(self.prefix)}
            touched |= {g for g in store.generations.known() if g.startswith(self.prefix)}
        for gen in touched:
            if not any(pending.get(p, store._usage.get(p, [0, 0]))[0] for p in groups if p.startswith(gen)):
                txn.delete(gen, db=store._generations)
                self.emptied.append(gen)

    def publish(self, pending):
        super().publish(pending)
        for gen in self.emptied:
            self.store.generations.forget(gen)


class _ReclaimOp(_DropOp):
    """One chunk of reclaiming a dead generation: a drop of its (namespace, fingerprint) prefix that
    first checks, in its own transaction, that the generation is still as planned: no write since
    (its last-write row unchanged, puts earlier in this transaction included), no live schedule, no
    recent read. Otherwise it deletes nothing and sets ``aborted``."""

    def __init__(self, store: Store, gen: Generation) -> None:
        super().__init__(store, gen.prefix)
        self.gen = gen
        self.aborted = False

    def apply(self, txn, pending):
        written = read_write_time(txn.get(self.gen.prefix, db=self.store._generations))
        self.aborted = written != self.gen.last_write or not self.store.generations.is_dead(self.gen.prefix)
        if self.aborted:
            self.emptied = []
            return 0, 0, True
        return super().apply(txn, pending)


class _DeleteOp(_StoreOp):
    """Deletes keys; with ``only_corrupt``, only those whose entry fails verification now
    (a fresh entry put since the corrupt read survives)."""

    frees_pages = True

    def __init__(self, store: Store, keys: Iterable[bytes], *, only_corrupt: bool = False) -> None:
        super().__init__(store)
        self.keys = list(keys)
        self.only_corrupt = only_corrupt

    def apply(self, txn, pending):
        deleted = 0
        for key in self.keys:
            old = txn.get(key, db=self.store._entries)
            if old is None or (self.only_corrupt and _verifies(old)):
                continue
            txn.delete(key, db=self.store._entries)
            self._adjust(txn, pending, key[:_GROUP_PREFIX_BYTES], -1, -len(old))
            deleted += 1
        return deleted


class _CreateNamespace(_StoreOp):
    """Creates a namespace (with its secret's hash); returns (info, created)."""

    def __init__(self, store: Store, name: str, secret_record: bytes | None) -> None:
        super().__init__(store)
        self.name = name
        self.secret_record = secret_record

    def apply(self, txn, pending):
        store = self.store
        existing = txn.get(self.name.encode(), db=store._namespaces)
        if existing is not None:
            return NamespaceInfo(struct.unpack(">I", existing)[0], self.name), False
        raw = txn.get(b"next_namespace_id", db=store._meta)
        ns_id = struct.unpack(">I", raw)[0] if raw else 1
        txn.put(self.name.encode(), struct.pack(">I", ns_id), db=store._namespaces)
        txn.put(b"next_namespace_id", struct.pack(">I", ns_id + 1), db=store._meta)
        if self.secret_record:
            txn.put(struct.pack(">I", ns_id), self.secret_record, db=store._secrets)
        return NamespaceInfo(ns_id, self.name), True

    def publish(self, pending):
        super().publish(pending)
        info, created = self.result_value
        if not created:
            return
        with self.store._lock:
            self.store._ns_by_name[info.name] = info.id
            self.store._ns_by_id[info.id] = info.name
            if self.secret_record:
                self.store._secret_of[info.id] = self.secret_record


def _verifies(value) -> bool:
    try:
        verify_entry(value)
    except InvalidRequest:
        return False
    return True
