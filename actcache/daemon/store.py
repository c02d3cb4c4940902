"""The LMDB activation store: one environment per daemon directory.

Named databases:
    entries     32-byte key (actcache.keys) -> encoded entry (actcache.codec)
    namespaces  name (utf-8) -> namespace id (u32, big-endian)
    groups      (namespace, fingerprint, depth) key prefix -> entries u64, bytes u64
    meta        format marker and the next namespace id

Concurrency: every write (put, drop, namespace creation, deleting a corrupt
entry) runs on the single writer thread, which batches queued operations
into one transaction; readers run in any thread. Reads locate each value in
``data.mdb`` and ``pread`` it (actcache.daemon.extents) unless
``explicit_reads`` is off, in which case they copy from the memory map. Usage counters live in the
``groups`` table, updated in the same transaction as the entries, so they are
exact across restarts. Invariant: for every group, the in-memory usage equals
the committed ``groups`` row.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import lmdb

from actcache.codec import compress_entry, verify_entry
from actcache.daemon.config import StoreConfig, format_size
from actcache.daemon.extents import ReadSession, ValueFile, stored_length
from actcache.daemon.writer import ReadGate, WriteOp, Writer
from actcache.errors import (
    BudgetExceeded,
    EntryCorrupt,
    InvalidRequest,
    NamespaceNotFound,
    StoreError,
)
from actcache.keys import encode_key, group_prefix

__all__ = ["GroupUsage", "NamespaceInfo", "PutResult", "Store"]

log = logging.getLogger(__name__)

FORMAT = b"actcache-store-1"
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_GROUP_PREFIX_BYTES = 4 + 16 + 2
_USAGE = struct.Struct(">QQ")


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    id: int
    name: str


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


class Store:
    """Entries of activations in LMDB, with byte budgets and exact usage accounting."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        config.dir.mkdir(parents=True, exist_ok=True)
        self._env = _open_env(config)
        self._entries = self._env.open_db(b"entries")
        self._namespaces = self._env.open_db(b"namespaces")
        self._groups = self._env.open_db(b"groups")
        self._meta = self._env.open_db(b"meta")
        self._gate = ReadGate()
        self._lock = threading.Lock()  # guards the in-memory maps below
        self._ns_by_name: dict[str, int] = {}
        self._ns_by_id: dict[int, str] = {}
        self._usage: dict[bytes, list[int]] = {}  # group prefix -> [entries, bytes]
        self._load()
        self._file = ValueFile(config.dir / "data.mdb", self._env.stat()["psize"])
        self._read_counts = {"explicit_reads": 0, "fallback_reads": 0}
        self._writer = Writer(self._env, self._gate, sync=config.sync, sync_interval_s=config.sync_interval_s)
        self._writer.start()

    # ---- lifecycle -------------------------------------------------------

    def close(self) -> None:
        """Finish queued writes, flush to disk and close the environment."""
        self._writer.stop()
        self._env.sync(True)
        self._env.close()
        self._file.close()

    def _load(self) -> None:
        with self._env.begin(write=True) as txn:
            marker = txn.get(b"format", db=self._meta)
            if marker is None:
                txn.put(b"format", FORMAT, db=self._meta)
            elif marker != FORMAT:
                raise StoreError(
                    f"{self.config.dir} holds store format {marker!r}, this daemon reads {FORMAT!r}; "
                    "point --dir at another directory or remove this one"
                )
            for name, value in txn.cursor(db=self._namespaces):
                ns_id = struct.unpack(">I", value)[0]
                self._ns_by_name[name.decode()] = ns_id
                self._ns_by_id[ns_id] = name.decode()
            for prefix, value in txn.cursor(db=self._groups):
                self._usage[bytes(prefix)] = list(_USAGE.unpack(value))

    # ---- namespaces ------------------------------------------------------

    def open_namespace(self, name: str, *, create: bool = True) -> NamespaceInfo:
        """Return the namespace called ``name``, creating it when ``create``."""
        if not _NAME_RE.fullmatch(name or ""):
            raise InvalidRequest(f"namespace name {name!r} is invalid; use 1-128 characters of A-Z a-z 0-9 . _ -")
        with self._lock:
            if name in self._ns_by_name:
                return NamespaceInfo(self._ns_by_name[name], name)
        if not create:
            raise NamespaceNotFound(f"namespace {name!r} does not exist; open it with create=True first")
        return self._writer.submit(_CreateNamespace(self, name))

    def namespace_name(self, namespace_id: int) -> str:
        with self._lock:
            name = self._ns_by_id.get(namespace_id)
        if name is None:
            raise NamespaceNotFound(f"namespace id {namespace_id} is not open on this daemon; call Open first")
        return name

    # ---- entries ---------------------------------------------------------

    def put(
        self, namespace_id: int, fingerprint: bytes, depth: int, items: Sequence[tuple[int, int, bytes | memoryview]]
    ) -> PutResult:
        """Validate, compress (when it pays) and commit ``(sample_id, variant, entry)`` items.

        Returns once the items are committed. All items of one call share a
        group and are committed atomically, or none is (budget, disk full).
        """
        self.namespace_name(namespace_id)
        prefix = group_prefix(namespace_id, fingerprint, depth)
        records = []
        for sample_id, variant, value in items:
            key = encode_key(namespace_id, fingerprint, depth, sample_id, variant)
            if len(value) > self.config.max_entry_bytes:
                raise InvalidRequest(
                    f"entry for sample {sample_id} is {format_size(len(value))}, above the "
                    f"{format_size(self.config.max_entry_bytes)} limit; raise --max-entry-bytes"
                )
            try:
                verify_entry(value)
            except InvalidRequest as exc:
                raise InvalidRequest(f"sample {sample_id} variant {variant}: {exc}") from None
            records.append((key, compress_entry(value, self.config.zstd_level)))
        if not records:
            return PutResult(0, 0, 0)
        return self._writer.submit(_PutOp(self, prefix, records))

    def get(
        self, namespace_id: int, fingerprint: bytes, depth: int, keys: Sequence[tuple[int, int]]
    ) -> list[bytes | memoryview | None]:
        """Return the entry of each ``(sample_id, variant)``, or None for a miss.

        A value that fails its checksum is deleted and EntryCorrupt raised.
        """
        self.namespace_name(namespace_id)
        encoded = [encode_key(namespace_id, fingerprint, depth, s, v) for s, v in keys]
        out: list[bytes | memoryview | None] = []
        corrupt: list[tuple[bytes, str]] = []
        with self.read_session() as session:
            extents = [session.locate(key) for key in encoded]
            for extent in extents:
                if extent is not None:
                    self._file.advise(extent)
            for key, extent in zip(encoded, extents):
                if extent is None:
                    out.append(None)
                    continue
                value = session.read(key, extent)
                try:
                    verify_entry(value)
                except InvalidRequest as exc:
                    corrupt.append((key, str(exc)))
                    out.append(None)
                    continue
                out.append(value)
        if corrupt:
            self.discard_corrupt([k for k, _ in corrupt])
            ids = [struct.unpack(">Q", k[22:30])[0] for k, _ in corrupt]
            raise EntryCorrupt(
                f"{len(corrupt)} stored entries failed verification and were deleted "
                f"(sample ids {ids[:8]}): {corrupt[0][1]}; recompute them"
            )
        return out

    @contextmanager
    def read_session(self) -> Iterator[ReadSession]:
        """A read transaction for locating and reading entries; keep it short (it pins pages)."""
        with self._gate.reading(), self._env.begin(db=self._entries, buffers=True) as txn:
            session = ReadSession(txn, self._file, explicit=self.config.explicit_reads)
            try:
                yield session
            finally:
                with self._lock:
                    self._read_counts["explicit_reads"] += session.explicit_reads
                    self._read_counts["fallback_reads"] += session.fallback_reads

    def probe(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Look ``keys`` up (in a transaction of their own); for each value not in the page cache, ask
        the kernel to start reading it. Per key: None if absent, else whether it was already cached
        (False also when the kernel cannot tell). Warms the cache ahead of a read, nothing more.
        """
        with self.read_session() as session:
            extents = [session.locate(key) for key in keys]
        out: list[bool | None] = []
        for extent in extents:
            if extent is None:
                out.append(None)
                continue
            resident = bool(self._file.resident(extent))
            if not resident:
                self._file.advise(extent)
            out.append(resident)
        return out

    def discard_corrupt(self, keys: Sequence[bytes]) -> int:
        """Delete those of ``keys`` whose stored entry still fails verification; returns how many."""
        return self._writer.submit(_DeleteOp(self, keys, only_corrupt=True))

    def read_counts(self) -> dict[str, int]:
        """Values read explicitly (pread) and by the fallback copy from the map, since start."""
        with self._lock:
            return dict(self._read_counts)

    def drop(self, namespace_id: int, fingerprint: bytes | None = None, depth: int | None = None) -> tuple[int, int]:
        """Delete a namespace's entries (narrowed by fingerprint and depth); returns (entries, bytes)."""
        self.namespace_name(namespace_id)
        return self._writer.submit(_DropOp(self, group_prefix(namespace_id, fingerprint, depth)))

    # ---- usage -----------------------------------------------------------

    def groups(self) -> list[GroupUsage]:
        with self._lock:
            rows = [(p, u[0], u[1]) for p, u in self._usage.items() if u[0]]
        return [
            GroupUsage(struct.unpack(">I", p[:4])[0], p[4:20], struct.unpack(">H", p[20:22])[0], n, b)
            for p, n, b in sorted(rows)
        ]

    def namespaces(self) -> list[tuple[NamespaceInfo, int, int]]:
        """Every namespace with its (entries, bytes)."""
        with self._lock:
            totals = {ns_id: [0, 0] for ns_id in self._ns_by_id}
            for prefix, (n, b) in self._usage.items():
                total = totals.setdefault(struct.unpack(">I", prefix[:4])[0], [0, 0])
                total[0] += n
                total[1] += b
            return [(NamespaceInfo(i, self._ns_by_id[i]), *totals[i]) for i in sorted(self._ns_by_id)]

    def used_bytes(self, namespace_id: int | None = None) -> int:
        with self._lock:
            return sum(
                u[1] for p, u in self._usage.items() if namespace_id is None or p[:4] == struct.pack(">I", namespace_id)
            )

    def map_size(self) -> int:
        return self._env.info()["map_size"]

    def file_bytes(self) -> int:
        """Bytes the data file occupies on disk (allocated blocks, not its apparent size)."""
        return os.stat(self.config.dir / "data.mdb").st_blocks * 512

    # ---- helpers for write operations (writer thread only) ---------------

    def _check_budget(self, prefix: bytes, delta: int, pending: dict[bytes, list[int]]) -> None:
        if delta <= 0:
            return
        ns = prefix[:4]

        def used(match) -> int:
            total = 0
            for p, u in self._usage.items():
                if match(p):
                    total += pending.get(p, u)[1]
            total += sum(u[1] for p, u in pending.items() if p not in self._usage and match(p))
            return total

        limit = self.config.namespace_budget_bytes
        if limit:
            ns_used = used(lambda p: p[:4] == ns)
            if ns_used + delta > limit:
                name = self._ns_by_id.get(struct.unpack(">I", ns)[0], "?")
                raise BudgetExceeded(
                    f"namespace {name!r} uses {ns_used} of its {limit} byte budget "
                    f"({format_size(ns_used)} of {format_size(limit)}) and this put needs {delta} more bytes; "
                    f"raise --namespace-budget or run `actcache drop {name}`"
                )
        limit = self.config.budget_bytes
        if limit:
            all_used = used(lambda p: True)
            if all_used + delta > limit:
                raise BudgetExceeded(
                    f"the daemon uses {all_used} of its {limit} byte budget "
                    f"({format_size(all_used)} of {format_size(limit)}) and this put needs {delta} more bytes; "
                    "raise --budget or drop namespaces with `actcache drop`"
                )


def _open_env(config: StoreConfig) -> lmdb.Environment:
    path = config.dir
    try:
        return lmdb.open(
            str(path),
            map_size=max(config.map_size_bytes, _existing_size(path)),
            max_dbs=8,
            max_readers=1024,
            sync=config.sync,
            metasync=config.sync,
            # Explicit reads do their own I/O; the map then only serves B-tree
            # pages, which must not drag in 8 MiB of readahead each.
            readahead=not config.explicit_reads,
            meminit=False,
        )
    except lmdb.InvalidError as exc:
        raise StoreError(
            f"{path / 'data.mdb'} is not a valid LMDB file ({exc}); it was damaged or written by another program. "
            "Move it aside or start with --dir on an empty directory"
        ) from exc
    except lmdb.Error as exc:
        raise StoreError(f"cannot open the store in {path}: {exc}") from exc


def _existing_size(path: Path) -> int:
    try:
        return (path / "data.mdb").stat().st_size
    except FileNotFoundError:
        return 0


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
        cursor = txn.cursor(db=db)
        for key, value in self.records:
            old = stored_length(cursor, key)
            if old is None:
                added += 1
                delta += len(value)
            else:
                replaced += 1
                delta += len(value) - old
        self.store._check_budget(self.prefix, delta, pending)
        for key, value in self.records:
            txn.put(key, value, db=db)
        self._adjust(txn, pending, self.prefix, added, delta)
        return PutResult(len(self.records), sum(len(v) for _, v in self.records), replaced)


class _DropOp(_StoreOp):
    def __init__(self, store: Store, prefix: bytes) -> None:
        super().__init__(store)
        self.prefix = prefix

    def apply(self, txn, pending):
        removed = _delete_range(txn, self.store._entries, self.prefix)
        entries = nbytes = 0
        for group in [p for p in set(self.store._usage) | set(pending) if p.startswith(self.prefix)]:
            usage = pending.get(group, self.store._usage.get(group, [0, 0]))
            entries += usage[0]
            nbytes += usage[1]
            pending[group] = [0, 0]
            txn.delete(group, db=self.store._groups)
        if removed != entries:
            log.warning("drop removed %d entries but usage counted %d", removed, entries)
        return removed, nbytes


class _DeleteOp(_StoreOp):
    """Deletes keys; with ``only_corrupt``, only those whose entry fails verification now
    (a fresh entry put since the corrupt read survives)."""

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
    def __init__(self, store: Store, name: str) -> None:
        super().__init__(store)
        self.name = name

    def apply(self, txn, pending):
        store = self.store
        existing = txn.get(self.name.encode(), db=store._namespaces)
        if existing is not None:
            return NamespaceInfo(struct.unpack(">I", existing)[0], self.name)
        raw = txn.get(b"next_namespace_id", db=store._meta)
        ns_id = struct.unpack(">I", raw)[0] if raw else 1
        txn.put(self.name.encode(), struct.pack(">I", ns_id), db=store._namespaces)
        txn.put(b"next_namespace_id", struct.pack(">I", ns_id + 1), db=store._meta)
        return NamespaceInfo(ns_id, self.name)

    def publish(self, pending):
        super().publish(pending)
        info: NamespaceInfo = self.result_value
        with self.store._lock:
            self.store._ns_by_name[info.name] = info.id
            self.store._ns_by_id[info.id] = info.name


def _verifies(value) -> bool:
    try:
        verify_entry(value)
    except InvalidRequest:
        return False
    return True


def _delete_range(txn, db, prefix: bytes) -> int:
    removed = 0
    cursor = txn.cursor(db=db)
    if not cursor.set_range(prefix):
        return 0
    while cursor.key()[: len(prefix)] == prefix:
        removed += 1
        if not cursor.delete():
            break
    return removed

