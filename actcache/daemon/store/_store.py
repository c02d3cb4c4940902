"""The LMDB activation store: one environment per daemon directory.

Named databases:
    entries     32-byte key (actcache.keys) -> encoded entry (actcache.codec)
    namespaces  name (utf-8) -> namespace id (u32, big-endian)
    groups      (namespace, fingerprint, depth) key prefix -> entries u64, bytes u64
    meta        format marker and the next namespace id
    secrets     namespace id (u32) -> salted scrypt hash of its secret (``_access``)
    generations (namespace, fingerprint) key prefix -> last write, f64 seconds (``_generations``)

Concurrency: every write runs on the single writer thread (``_writer``), which batches queued
operations (``_ops``) into one transaction; readers run in any thread. Invariant: for every group,
the in-memory usage (``StoreState``) equals the committed ``groups`` row.

Budgets: a put is refused with BudgetExceeded past a budget, or when it would leave less than
``disk_reserve_bytes`` free so that drops can always commit. Over a budget the put's transaction
only plans a reclaim of dead generations and raises; the caller's thread drops them and puts again.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import lmdb
import numpy as np

from actcache.codec import Codec, Encoding, compress_entry, verify_entry
from actcache.daemon.config import StoreConfig, format_size
from actcache.daemon.store._access import Handles, check_secret, hash_secret, verify_secret
from actcache.daemon.store._dirlock import DirLock
from actcache.daemon.store._envfile import DAMAGE_ERRORS, DB_NAMES, UnusableStore, damaged, move_aside, open_env
from actcache.daemon.store._extents import ExtentHints, PageCacheGuess, ReadSession, ValueFile
from actcache.daemon.store._generations import Generation, Generations, ReclaimPlan, plan_reclaim
from actcache.daemon.store._ops import _CreateNamespace, _DeleteOp, _DropOp, _PutOp, _ReclaimNeeded, _ReclaimOp
from actcache.daemon.store._pages import check_layout
from actcache.daemon.store._state import GroupUsage, NamespaceInfo, PutResult, StoreState
from actcache.daemon.store._writer import ReadGate, Writer, free_bytes
from actcache.errors import (
    BudgetExceeded,
    EntryCorrupt,
    InvalidRequest,
    NamespaceNotFound,
    PermissionDenied,
    StoreError,
)
from actcache.keys import (
    MAX_NAMESPACE_ID,
    encode_key,
    encode_keys,
    generation_of,
    group_prefix,
    namespace_id_of,
    namespace_of,
    sample_id_of,
    split_group,
)

__all__ = ["GroupUsage", "NamespaceInfo", "PutResult", "Store"]

log = logging.getLogger(__name__)

FORMAT = b"actcache-store-1"
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Plan-reclaim-retry rounds of one put before it is refused (concurrent puts may take the room freed).
_RECLAIM_ROUNDS = 3
_Op = TypeVar("_Op", bound=_DropOp)


class Store:
    """Entries of activations in LMDB, with byte budgets and exact usage accounting."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._encoding = Encoding.parse(config.encoding)
        config.dir.mkdir(parents=True, exist_ok=True)
        # One daemon per directory: a second one refuses here, naming the holder's pid.
        self._dir_lock = DirLock.acquire(config.dir)
        self._gate = ReadGate()
        try:
            try:
                self._open()
            except UnusableStore as exc:
                if config.on_corrupt != "move-aside":
                    raise StoreError(
                        f"{exc}. Restart with --on-corrupt move-aside to keep these files as *.corrupt-<time> and "
                        "start with an empty cache, or point --dir at an empty directory") from None
                moved = move_aside(config.dir)
                log.warning("%s; moved %s aside and started an empty cache", exc, ", ".join(str(p) for p in moved))
                self._open()
        except BaseException:
            self._dir_lock.release()
            raise
        self._file = ValueFile(config.dir / "data.mdb", self._env.stat()["psize"])
        self._read_counts = {"explicit_reads": 0, "fallback_reads": 0, "cached_copies": 0}
        try:  # the leaf-page reader must find a known value written into meta, else it is turned off
            problem = check_layout(self._env, self._state.meta, self._file.pages)
        except (lmdb.Error, OSError) as exc:
            problem = f"the check could not run: {exc}"
        #: 1 when the leaf-page reader did not read this LMDB's layout at open (its hints are then off).
        self.page_layout_unrecognized = int(problem is not None)
        if problem is not None:
            self._file.pages.enabled = False
            log.warning("LMDB %s: its on-disk page layout is not the one this daemon reads (%s); leaf-page hints "
                        "and explicit reads are off, values are copied from LMDB's map", lmdb.version(), problem)
        stale = self._env.reader_check()
        if stale:
            log.info("cleared %d stale LMDB reader slots left by a crashed process", stale)
        self._writer = Writer(self._env, self._gate, config, meta_db=self._state.meta,
                              on_remap=self._file.pages.remapped)

    def _open(self) -> None:
        """Open and check the environment and load the in-memory maps; raises UnusableStore."""
        # Explicit reads do their own I/O; the map then only serves B-tree pages, which must not
        # drag in 8 MiB of readahead each.
        self._env = open_env(self.config.dir, map_size=self.config.map_size_bytes, sync=self.config.sync,
                             readahead=not self.config.explicit_reads)
        self._handles = Handles()
        try:
            entries, namespaces, groups, meta, secrets, generation_times = (self._env.open_db(n) for n in DB_NAMES)
            self._state = state = StoreState(self._env, entries, namespaces, groups, meta, secrets, generation_times,
                                             generations=Generations(self.config.reclaim_after_s))
            with self._env.begin(write=True) as txn:
                marker = txn.get(b"format", db=state.meta)
                if marker is None:
                    if any(txn.stat(db)["entries"] for db in (state.entries, state.namespaces, state.groups)):
                        raise UnusableStore(
                            f"{self.config.dir / 'data.mdb'} holds actcache tables but no format marker; "
                            "it was damaged or written by another program")
                    txn.put(b"format", FORMAT, db=state.meta)
                elif marker != FORMAT:
                    raise UnusableStore(f"{self.config.dir} holds store format {marker!r}, "
                                        f"this daemon reads {FORMAT!r}")
                state.load(txn)
        except BaseException as exc:
            self._env.close()
            if isinstance(exc, DAMAGE_ERRORS):
                raise UnusableStore(f"{self.config.dir / 'data.mdb'} is damaged: {exc}") from None
            raise

    # ---- lifecycle -------------------------------------------------------

    def close(self) -> None:
        """Finish queued writes, flush to disk and close the environment."""
        self._writer.stop()
        self._env.sync(True)
        self._env.close()
        self._file.close()
        self._dir_lock.release()

    @property
    def generations(self) -> Generations:
        """Last write, last read and live schedules of each (namespace, fingerprint)."""
        return self._state.generations

    # ---- namespaces ------------------------------------------------------

    def open_namespace(self, name: str, *, create: bool = True, secret: bytes | None = None) -> NamespaceInfo:
        """Return the namespace called ``name`` with its handle, creating it when ``create``. A namespace
        created with a ``secret`` can only be opened with it (PermissionDenied otherwise); see ``_access``."""
        if not _NAME_RE.fullmatch(name or ""):
            raise InvalidRequest(f"namespace name {name!r} is invalid; use 1-128 characters of A-Z a-z 0-9 . _ -")
        secret = check_secret(secret)
        state = self._state
        with state.lock:
            ns_id = state.ns_by_name.get(name)
        if ns_id is None:
            if not create:
                raise NamespaceNotFound(f"namespace {name!r} does not exist; open it with create=True first")
            record = hash_secret(secret) if secret else None
            info, created = self._writer.submit(_CreateNamespace(state, name, record))
            if created:
                return NamespaceInfo(info.id, name, self._handles.issue(info.id) if record else info.id)
            ns_id = info.id  # created concurrently by another caller: its secret decides
        with state.lock:
            record = state.secret_of.get(ns_id)
        if record is None:
            if secret:
                raise PermissionDenied(
                    f"namespace {name!r} was created without a secret and cannot get one; "
                    "open it without a secret, or protect a new namespace under another name")
            return NamespaceInfo(ns_id, name, ns_id)
        if not secret:
            raise PermissionDenied(f"namespace {name!r} is protected by a secret; pass it to Open")
        if not verify_secret(secret, record):
            raise PermissionDenied(f"wrong secret for namespace {name!r}")
        return NamespaceInfo(ns_id, name, self._handles.issue(ns_id))

    def resolve(self, handle: int) -> int:
        """The namespace id a request's ``namespace_id`` (a handle from Open) stands for; every method taking
        a ``namespace_id`` resolves it here first. A protected namespace is reachable only by its handle."""
        if handle > MAX_NAMESPACE_ID:
            ns_id = self._handles.namespace_of(handle)
            if ns_id is None:
                raise NamespaceNotFound(
                    f"namespace handle {handle} is not known to this daemon; handles of protected namespaces "
                    "last one daemon run, so call Open again with the namespace's secret")
            return ns_id
        with self._state.lock:
            name = self._state.ns_by_id.get(handle)
            protected = handle in self._state.secret_of
        if name is None:
            raise NamespaceNotFound(f"namespace id {handle} is not open on this daemon; call Open first")
        if protected:
            raise PermissionDenied(
                f"namespace {name!r} is protected by a secret; address it by the handle Open returned, not its id")
        return handle

    # ---- entries ---------------------------------------------------------

    def put(
        self, namespace_id: int, fingerprint: bytes, depth: int, items: Sequence[tuple[int, int, bytes | memoryview]],
        *, encoding: Encoding | None = None,
    ) -> PutResult:
        """Validate, compress (when it pays) and commit ``(sample_id, variant, entry)`` items of one group,
        all or none (budget, disk full); returns once committed. ``encoding`` (the client's choice for
        this group) replaces the daemon's ``--encoding``."""
        namespace_id = self.resolve(namespace_id)
        records = []
        encoding = encoding or self._encoding
        for sample_id, variant, value in items:
            key = encode_key(namespace_id, fingerprint, depth, sample_id, variant)
            if len(value) > self.config.max_entry_bytes:
                raise InvalidRequest(
                    f"entry for sample {sample_id} is {format_size(len(value))}, above the "
                    f"{format_size(self.config.max_entry_bytes)} limit; raise --max-entry-bytes")
            try:
                if verify_entry(value).codec == Codec.raw_verified:
                    raise InvalidRequest("a raw_verified entry carries no payload checksum and is never "
                                         "stored; put it with the raw or zstd codec")
            except InvalidRequest as exc:
                raise InvalidRequest(f"sample {sample_id} variant {variant}: {exc}") from None
            records.append((key, compress_entry(value, encoding)))
        return self._commit(group_prefix(namespace_id, fingerprint, depth), records)

    def put_rows(
        self, namespace_id: int, fingerprint: bytes, depth: int, sample_ids: np.ndarray, variants: np.ndarray | None,
        rows: np.ndarray, *, encoding: Encoding | None = None,
    ) -> PutResult:
        """Commit raw entries the daemon encoded itself (``encode_batch``: row i for ``sample_ids[i]``, uint64,
        and ``variants[i]``, uint16; None: all 0), compressed when it pays, as ``put`` does; their checksums,
        just computed, are not checked again."""
        namespace_id = self.resolve(namespace_id)
        if len(rows) and rows.shape[1] > self.config.max_entry_bytes:
            raise InvalidRequest(f"entries of {format_size(rows.shape[1])} are above the "
                                 f"{format_size(self.config.max_entry_bytes)} limit; raise --max-entry-bytes")
        encoding = encoding or self._encoding
        keys = encode_keys(namespace_id, fingerprint, depth, sample_ids, variants)
        return self._commit(group_prefix(namespace_id, fingerprint, depth),
                            [(key, compress_entry(memoryview(row), encoding)) for key, row in zip(keys, rows)])

    def _commit(self, prefix: bytes, records: list[tuple[bytes, bytes | memoryview]]) -> PutResult:
        """Commit one group's ``(key, value)`` records, reclaiming space first when the budget asks for it."""
        if not records:
            return PutResult(0, 0, 0)
        for round_ in range(_RECLAIM_ROUNDS):
            try:
                return self._writer.submit(_PutOp(self._state, prefix, records, check_room=self._check_room,
                                                  stored_length=self._file.pages.stored_length))
            except _ReclaimNeeded as need:
                if round_ == _RECLAIM_ROUNDS - 1:
                    raise BudgetExceeded(str(need)) from None
                self._reclaim(need.plan)
        raise AssertionError("unreachable")

    def get(self, namespace_id: int, fingerprint: bytes, depth: int, keys: Sequence[tuple[int, int]], *,
            max_bytes: int | None = None) -> list[bytes | memoryview | None]:
        """Return the entry of each ``(sample_id, variant)``, or None for a miss. With ``max_bytes``, stops
        once the values read reach that many bytes (after at least one key): the result is then a prefix
        of ``keys``. A value that fails its checksum is deleted and EntryCorrupt raised."""
        namespace_id = self.resolve(namespace_id)
        encoded = [encode_key(namespace_id, fingerprint, depth, s, v) for s, v in keys]
        if encoded:
            self.generations.read(generation_of(encoded[0]))
        out: list[bytes | memoryview | None] = []
        corrupt: list[tuple[bytes, str]] = []
        nbytes = 0
        try:
            with self.read_session() as session:
                extents = []
                for key in encoded:  # locate up to max_bytes, then hint the kernel to read them all at once
                    if max_bytes is not None and nbytes >= max_bytes:
                        break
                    extents.append(session.locate(key))
                    nbytes += 0 if extents[-1] is None else extents[-1].length
                for extent in extents:
                    if extent is not None:
                        self._file.advise(extent)
                for key, extent in zip(encoded, extents):
                    value = None if extent is None else session.read(key, extent)
                    if value is not None:
                        try:
                            verify_entry(value)
                        except InvalidRequest as exc:
                            corrupt.append((key, str(exc)))
                            value = None
                    out.append(value)
        except DAMAGE_ERRORS as exc:
            raise damaged(self.config.dir, "a read", exc) from None
        if corrupt:
            self.discard_corrupt([k for k, _ in corrupt])
            ids = [sample_id_of(k) for k, _ in corrupt]
            raise EntryCorrupt(
                f"{len(corrupt)} stored entries failed verification and were deleted "
                f"(sample ids {ids[:8]}): {corrupt[0][1]}; recompute them")
        return out

    @contextmanager
    def read_session(self, guess: PageCacheGuess | None = None) -> Iterator[ReadSession]:
        """A read transaction for locating and reading entries; keep it short (it pins pages).
        ``guess``: the reader's, so values the page cache holds are copied out of the map."""
        with self._gate.reading(), self._env.begin(db=self._state.entries, buffers=True) as txn:
            session = ReadSession(txn, self._file, explicit=self.config.explicit_reads, guess=guess)
            try:
                yield session
            finally:
                with self._state.lock:
                    for name in self._read_counts:
                        self._read_counts[name] += getattr(session, name)

    def contains(self, namespace_id: int, fingerprint: bytes, depth: int, sample_ids: "np.ndarray",
                 variants: "np.ndarray | None" = None) -> list[bool]:
        """Whether each sample id (uint64 array; variants uint16 or None for 0) is stored; reads no value
        past its first page, and a cold group costs one random read per leaf page (``LeafPages.present_keys``)."""
        keys = encode_keys(self.resolve(namespace_id), fingerprint, depth, sample_ids, variants)
        if keys:
            self.generations.read(generation_of(keys[0]))
        with self._gate.reading(), self._env.begin(db=self._state.entries, buffers=True) as txn:
            return self._file.pages.present_keys(txn.cursor(), keys)

    def probe(self, keys: Sequence[bytes], hints: ExtentHints | None = None, start: int = 0) -> list[bool | None]:
        """Look ``keys`` up and ask the kernel to read ahead each value not in the page cache. Per key: None if
        absent, else whether it was cached (False also when the kernel cannot tell). ``hints``: the schedule's
        extents learned by earlier probes, taught by this one; ``keys`` are then its positions ``start`` on."""
        with self.read_session() as session:
            if hints is None:
                extents = [session.locate(key) for key in keys]
            else:
                known = hints.take_range(start, start + len(keys))
                extents = [extent or session.locate_hinted(key, hints) for key, extent in zip(keys, known)]
        out: list[bool | None] = []
        for extent in extents:
            resident = None if extent is None else bool(self._file.resident(extent))
            out.append(resident)
            if extent is not None and resident is False:
                self._file.advise(extent)
        return out

    def discard_corrupt(self, keys: Sequence[bytes]) -> int:
        """Delete those of ``keys`` whose stored entry still fails verification; returns how many."""
        return self._writer.submit(_DeleteOp(self._state, keys))

    def read_counts(self) -> dict[str, int]:
        """Values read explicitly (pread) and by the fallback copy from the map, since start."""
        with self._state.lock:
            return dict(self._read_counts)

    def drop(self, namespace_id: int, fingerprint: bytes | None = None, depth: int | None = None) -> tuple[int, int]:
        """Delete a namespace's entries (narrowed by fingerprint and depth); returns (entries, bytes)."""
        prefix = group_prefix(self.resolve(namespace_id), fingerprint, depth)
        return self._drop_chunks(lambda: _DropOp(self._state, prefix))[:2]

    def _drop_chunks(self, chunk: Callable[[], _Op]) -> tuple[int, int, _Op]:
        """Submit ``chunk()`` ops until one says it is done; (entries, bytes) deleted and the last op."""
        entries = nbytes = 0
        while True:
            op = chunk()
            removed, freed, done = self._writer.submit(op)
            entries, nbytes = entries + removed, nbytes + freed
            if done:
                return entries, nbytes, op

    def _reclaim(self, plan: ReclaimPlan) -> None:
        """Drop the generations of ``plan`` (caller's thread; each chunk runs on the writer thread)."""
        for gen in plan.victims:
            entries, nbytes, op = self._drop_chunks(functools.partial(_ReclaimOp, self._state, gen))
            with self._state.lock:
                name = self._state.ns_by_id.get(gen.namespace_id, str(gen.namespace_id))
            self.generations.reclaimed(name, gen, entries, nbytes, complete=not op.aborted)

    # ---- usage -----------------------------------------------------------

    def generation_stats(self) -> list[Generation]:
        """Every stored generation (namespace, fingerprint) with its bytes, activity and whether it is dead now."""
        with self._state.lock:
            rows = [(p, b) for p, (n, b) in self._state.usage.items() if n]
        return self.generations.snapshot(_by_generation(rows))

    def groups(self) -> list[GroupUsage]:
        with self._state.lock:
            rows = [(p, u[0], u[1]) for p, u in self._state.usage.items() if u[0]]
        return [GroupUsage(*split_group(p), n, b) for p, n, b in sorted(rows)]

    def namespaces(self) -> list[tuple[NamespaceInfo, int, int]]:
        """Every namespace with its (entries, bytes)."""
        state = self._state
        with state.lock:
            totals = {ns_id: [0, 0] for ns_id in state.ns_by_id}
            for prefix, (n, b) in state.usage.items():
                total = totals.setdefault(namespace_id_of(prefix), [0, 0])
                total[0] += n
                total[1] += b
            return [(NamespaceInfo(i, state.ns_by_id[i]), totals[i][0], totals[i][1]) for i in sorted(state.ns_by_id)]

    def used_bytes(self, namespace_id: int | None = None) -> int:
        with self._state.lock:
            return sum(u[1] for p, u in self._state.usage.items()
                       if namespace_id is None or namespace_id_of(p) == namespace_id)

    def map_size(self) -> int:
        return self._env.info()["map_size"]

    def file_bytes(self) -> int:
        """Bytes the data file occupies on disk (allocated blocks, not its apparent size)."""
        return os.stat(self.config.dir / "data.mdb").st_blocks * 512

    # ---- helpers for write operations (writer thread only) ---------------

    def _check_room(self, txn, prefix: bytes, delta: int, nbytes: int, pending: dict[bytes, list[int]]) -> None:
        """A put's check: its group's budgets, then that its ``nbytes`` leave the disk reserve kept for drops."""
        self._check_budget(prefix, delta, pending)
        reserve = self.config.disk_reserve_bytes
        if not reserve:
            return
        free = free_bytes(self.config.dir)
        if free - nbytes >= reserve:
            return
        # About how many bytes of data.mdb are free pages LMDB will reuse: file pages minus tree and meta pages.
        s, main = self._state, self._env.stat()
        tables = (s.entries, s.namespaces, s.groups, s.meta, s.secrets, s.generation_times)
        used = 2 + sum(st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
                       for st in [main, *(txn.stat(db) for db in tables)])
        reusable = max(0, self._env.info()["last_pgno"] + 1 - used) * main["psize"]
        if free + reusable - nbytes >= reserve:
            return
        raise BudgetExceeded(
            f"the disk holding {self.config.dir} has {free} bytes free ({format_size(free)}) plus about {reusable} "
            f"reusable inside data.mdb, and this put needs {nbytes} bytes while {reserve} bytes "
            f"({format_size(reserve)}) stay reserved so that drops can commit; free space on that file system, "
            "run `actcache drop`, or lower --disk-reserve. Reads keep working")

    def _check_budget(self, prefix: bytes, delta: int, pending: dict[bytes, list[int]]) -> None:
        """Refuse ``delta`` more bytes in group ``prefix`` past a budget (before any write of the op): _ReclaimNeeded
        when dropping dead generations makes the put fit (the caller reclaims and puts again), else BudgetExceeded."""
        ns_limit, limit = self.config.namespace_budget_bytes, self.config.budget_bytes
        if delta <= 0 or not (ns_limit or limit):
            return
        ns = namespace_of(prefix)
        group_bytes = {p: u[1] for p, u in self._state.usage.items()} | {p: u[1] for p, u in pending.items()}
        all_used = sum(group_bytes.values())
        ns_used = sum(b for p, b in group_bytes.items() if namespace_of(p) == ns)
        ns_need = ns_used + delta - ns_limit if ns_limit else 0
        all_need = all_used + delta - limit if limit else 0
        if ns_need <= 0 and all_need <= 0:
            return
        busy = {generation_of(p) for p in pending}  # touched in this transaction: not planned around
        generations = self.generations.snapshot(_by_generation(group_bytes.items()))
        dead = [g for g in generations if g.dead and g.prefix not in busy]
        plan = plan_reclaim(dead, own=generation_of(prefix), namespace=ns, namespace_need=ns_need,
                            daemon_need=all_need)
        if ns_need > 0:
            name = self._state.ns_by_id.get(namespace_id_of(ns), "?")
            who, used, cap = f"namespace {name!r}", ns_used, ns_limit
            fix = f"raise --namespace-budget, lower --reclaim-after or run `actcache drop {name}`"
        else:
            who, used, cap = "the daemon", all_used, limit
            fix = "raise --budget, lower --reclaim-after or drop namespaces with `actcache drop`"
        message = (f"{who} uses {used} of its {cap} byte budget ({format_size(used)} of {format_size(cap)}) and this "
                   f"put needs {delta} more bytes; {self.generations.describe(plan)}; {fix}")
        if plan.fits:
            raise _ReclaimNeeded(message, plan)
        raise BudgetExceeded(message)


def _by_generation(group_bytes: Iterable[tuple[bytes, int]]) -> dict[bytes, int]:
    """Bytes per generation, from (group prefix, bytes) rows."""
    sizes: dict[bytes, int] = {}
    for prefix, nbytes in group_bytes:
        sizes[generation_of(prefix)] = sizes.get(generation_of(prefix), 0) + nbytes
    return sizes
