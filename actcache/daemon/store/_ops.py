"""The store's write operations, applied by its writer thread inside one shared LMDB transaction.

Each changes entries and the per-group usage rows together, and publishes its effect on the
in-memory maps only after the transaction committed (``publish``).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from actcache.codec import verify_entry
from actcache.daemon.store._generations import Generation, ReclaimPlan, read_write_time, write_time
from actcache.daemon.store._state import NAMESPACE_ID, USAGE, NamespaceInfo, PutResult, StoreState
from actcache.daemon.store._writer import WriteOp
from actcache.errors import BudgetExceeded, InvalidRequest
from actcache.keys import GENERATION_PREFIX_BYTES, generation_of, group_of, group_prefix

__all__: list[str] = []  # internal to the store

log = logging.getLogger("actcache.daemon.store")

_DROP_CHUNK_BYTES = 256 << 20
_DROP_CHUNK_ENTRIES = 100_000


class _ReclaimNeeded(BudgetExceeded):
    """A put fits once ``plan``'s dead generations are dropped (never leaves Store.put)."""

    def __init__(self, message: str, plan: ReclaimPlan) -> None:
        super().__init__(message)
        self.plan = plan


class _StoreOp(WriteOp):
    """A write operation on the store; applied by the writer inside a shared transaction."""

    def __init__(self, state: StoreState) -> None:
        super().__init__()
        self.state = state

    def _adjust(self, txn, pending: dict[bytes, list[int]], prefix: bytes, entries: int, nbytes: int) -> None:
        usage = pending.setdefault(prefix, list(self.state.usage.get(prefix, [0, 0])))
        usage[0] += entries
        usage[1] += nbytes
        txn.put(prefix, USAGE.pack(*usage), db=self.state.groups)

    def publish(self, pending: dict[bytes, list[int]]) -> None:
        with self.state.lock:
            self.state.usage.update({p: list(u) for p, u in pending.items()})


class _PutOp(_StoreOp):
    """Writes ``records`` into group ``prefix``. ``stored_length(cursor, key)``: the size of a stored value
    or None; ``check_room(txn, prefix, delta, nbytes, pending)`` raises when the put does not fit."""

    def __init__(self, state: StoreState, prefix: bytes, records: list[tuple[bytes, bytes | memoryview]], *,
                 stored_length: Callable, check_room: Callable) -> None:
        super().__init__(state)
        self.prefix = prefix
        self.records = records
        self.nbytes = sum(len(v) for _, v in records)
        self._stored_length = stored_length
        self._check_room = check_room

    def apply(self, txn, pending):
        db = self.state.entries
        replaced = delta = 0
        sizes: dict[bytes, int] = {}  # stored size of each key as this op leaves it
        cursor = txn.cursor(db=db)
        for key, value in self.records:
            old = sizes[key] if key in sizes else self._stored_length(cursor, key)
            replaced += old is not None
            delta += len(value) - (old or 0)
            sizes[key] = len(value)
        added = len(self.records) - replaced
        self._check_room(txn, self.prefix, delta, self.nbytes, pending)
        for key, value in self.records:
            txn.put(key, value, db=db)
        self._adjust(txn, pending, self.prefix, added, delta)
        self.written = self.state.generations.now()
        txn.put(generation_of(self.prefix), write_time(self.written), db=self.state.generation_times)
        return PutResult(len(self.records), self.nbytes, replaced)

    def publish(self, pending):
        super().publish(pending)
        self.state.generations.wrote(generation_of(self.prefix), self.written)


class _DropOp(_StoreOp):
    """Deletes the next chunk of entries under ``prefix``; returns (entries, bytes, done)."""

    frees_pages = True

    def __init__(self, state: StoreState, prefix: bytes) -> None:
        super().__init__(state)
        self.prefix = prefix
        self.emptied: list[bytes] = []  # generations left without entries (their last-write rows went)

    def apply(self, txn, pending):
        self.emptied = []
        removed: dict[bytes, list[int]] = {}
        entries = nbytes = 0
        cursor = txn.cursor(db=self.state.entries)
        done = not cursor.set_range(self.prefix)
        while not done and bytes(cursor.key()[: len(self.prefix)]) == self.prefix:
            if entries >= _DROP_CHUNK_ENTRIES or nbytes >= _DROP_CHUNK_BYTES:
                break
            size = len(cursor.value())
            counts = removed.setdefault(bytes(group_of(cursor.key())), [0, 0])
            counts[0] += 1
            counts[1] += size
            entries += 1
            nbytes += size
            done = not cursor.delete()
        else:  # no key of the prefix left
            done = True
        for group, (n, b) in removed.items():
            self._adjust(txn, pending, group, -n, -b)
        if not done:
            return entries, nbytes, done
        # Usage rows of the dropped groups go too (and any drift between rows and entries with them).
        state = self.state
        groups = set(state.usage) | set(pending)
        for group in [p for p in groups if p.startswith(self.prefix)]:
            usage = pending.get(group, state.usage.get(group, [0, 0]))
            if usage != [0, 0]:
                log.warning("drop: usage of group %s was %s after its entries were deleted", group.hex(), usage)
            pending[group] = [0, 0]
            txn.delete(group, db=state.groups)
        # Then the last-write rows of the generations left without entries.
        if len(self.prefix) >= GENERATION_PREFIX_BYTES:
            touched = {generation_of(self.prefix)}
        else:
            touched = {generation_of(p) for p in groups if p.startswith(self.prefix)}
            touched |= {g for g in state.generations.known() if g.startswith(self.prefix)}
        for gen in touched:
            if not any(pending.get(p, state.usage.get(p, [0, 0]))[0] for p in groups if p.startswith(gen)):
                txn.delete(gen, db=state.generation_times)
                self.emptied.append(gen)
        return entries, nbytes, done

    def publish(self, pending):
        super().publish(pending)
        for gen in self.emptied:
            self.state.generations.forget(gen)


class _ReclaimOp(_DropOp):
    """One chunk of reclaiming a dead generation: a drop of its (namespace, fingerprint) prefix that
    first checks, in its own transaction, that the generation is still as planned: no write since
    (its last-write row unchanged, puts earlier in this transaction included), no live schedule, no
    recent read. Otherwise it deletes nothing and sets ``aborted``."""

    def __init__(self, state: StoreState, gen: Generation) -> None:
        super().__init__(state, gen.prefix)
        self.gen = gen
        self.aborted = False

    def apply(self, txn, pending):
        written = read_write_time(txn.get(self.gen.prefix, db=self.state.generation_times))
        self.aborted = written != self.gen.last_write or not self.state.generations.is_dead(self.gen.prefix)
        if self.aborted:
            self.emptied = []
            return 0, 0, True
        return super().apply(txn, pending)


class _DeleteOp(_StoreOp):
    """Deletes those of ``keys`` whose entry fails verification now (one put since the corrupt read survives)."""

    frees_pages = True

    def __init__(self, state: StoreState, keys: Iterable[bytes]) -> None:
        super().__init__(state)
        self.keys = list(keys)

    def apply(self, txn, pending):
        deleted = 0
        for key in self.keys:
            old = txn.get(key, db=self.state.entries)
            if old is None or not _corrupt(old):
                continue
            txn.delete(key, db=self.state.entries)
            self._adjust(txn, pending, group_of(key), -1, -len(old))
            deleted += 1
        return deleted


def _corrupt(value: bytes) -> bool:
    try:
        verify_entry(value)
    except InvalidRequest:
        return True
    return False


class _CreateNamespace(_StoreOp):
    """Creates a namespace (with its secret's hash); returns (info, created)."""

    def __init__(self, state: StoreState, name: str, secret_record: bytes | None) -> None:
        super().__init__(state)
        self.name = name
        self.secret_record = secret_record

    def apply(self, txn, pending):
        state = self.state
        existing = txn.get(self.name.encode(), db=state.namespaces)
        if existing is not None:
            return NamespaceInfo(NAMESPACE_ID.unpack(existing)[0], self.name), False
        raw = txn.get(b"next_namespace_id", db=state.meta)
        ns_id = NAMESPACE_ID.unpack(raw)[0] if raw else 1
        txn.put(self.name.encode(), NAMESPACE_ID.pack(ns_id), db=state.namespaces)
        txn.put(b"next_namespace_id", NAMESPACE_ID.pack(ns_id + 1), db=state.meta)
        if self.secret_record:
            txn.put(group_prefix(ns_id), self.secret_record, db=state.secrets)
        return NamespaceInfo(ns_id, self.name), True

    def publish(self, pending):
        super().publish(pending)
        info, created = self.result_value
        if created:
            with self.state.lock:
                self.state.ns_by_name[info.name] = info.id
                self.state.ns_by_id[info.id] = info.name
                if self.secret_record:
                    self.state.secret_of[info.id] = self.secret_record

