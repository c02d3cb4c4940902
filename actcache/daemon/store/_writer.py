"""The store's single writer thread: batches queued write operations into one LMDB transaction.

Invariants: exactly one thread writes; an operation's caller is woken with its result or its
exception, never left waiting; the map grows (doubling) when LMDB reports it full, while no read
transaction is open in the process.

A full disk is an answer, not a crash: the commit's short ``pwrite`` surfaces as EIO (not ENOSPC),
the transaction aborts and the environment stays usable. The writer answers BudgetExceeded quoting
the free bytes, and retries a failed batch op by op so that a drop queued behind a put still frees
space. Freed pages become reusable two commits later, so an op that frees pages is followed by a
one-key commit. Before growing the map the writer probes the address space (a failed remap would
invalidate the environment); should the remap fail anyway, the store is marked broken and every
later read and write fails with StoreError.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import struct
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import lmdb

from actcache.daemon.config import StoreConfig, format_size
from actcache.daemon.store._envfile import damaged
from actcache.errors import ActCacheError, BudgetExceeded, StoreError

__all__ = ["ReadGate", "WriteOp", "Writer", "free_bytes"]

log = logging.getLogger(__name__)

_MAX_OPS_PER_TXN = 512
_MAX_BYTES_PER_TXN = 64 << 20
# A batch may need several doublings (1 MiB map, 64 MiB batch); more means a bug.
_MAX_GROWTHS_PER_BATCH = 16
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
# Failed commits with less free disk than this (besides the batch) count as disk full.
_DISK_FULL_SLACK = 1 << 20


class ReadGate:
    """Lets readers in concurrently and a map resize in alone: LMDB allows ``set_mapsize`` only while
    the process has no open transaction, so readers hold the gate while theirs is open. A thread already
    reading enters again without waiting for a pending resize (a prefetch reader probes ahead while its
    own transaction is open): the resize waits for it either way, so making it wait would deadlock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._exclusive = False
        self._mine = threading.local()  # .depth: this thread's open readings
        self.broken: str | None = None

    def check(self) -> None:
        """Raise StoreError if the environment became unusable."""
        if self.broken is not None:
            raise StoreError(self.broken)

    @contextmanager
    def reading(self) -> Iterator[None]:
        depth = getattr(self._mine, "depth", 0)
        with self._cond:
            if not depth:
                self._cond.wait_for(lambda: not self._exclusive)
            self.check()
            self._readers += 1
        self._mine.depth = depth + 1
        try:
            yield
        finally:
            self._mine.depth = depth
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._exclusive = True
            self._cond.wait_for(lambda: not self._readers)
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class WriteOp:
    """One queued write. ``apply`` must raise before its first write or not at all (LMDB errors abort
    the whole transaction). ``nbytes``: what it adds to the file at most; ``frees_pages`` asks for a
    follow-up commit so that the freed pages become reusable."""

    nbytes: int = 0
    frees_pages: bool = False

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result_value: Any = None
        self.error: BaseException | None = None

    def apply(self, txn: lmdb.Transaction, pending: dict[bytes, list[int]]) -> Any:
        raise NotImplementedError

    def publish(self, pending: dict[bytes, list[int]]) -> None:
        """Make the committed effects visible in memory (called after commit)."""

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result_value, self.error = result, error
        self.done.set()


_STOP = object()


class Writer:
    """Runs queued WriteOps in batches on one thread; ``submit`` blocks until committed."""

    def __init__(self, env: lmdb.Environment, gate: ReadGate, config: StoreConfig, *, meta_db,
                 on_remap: Callable[[], None]) -> None:
        """``on_remap``: called after the map moved (it grew), before any reader may start again."""
        self._env, self._gate, self._meta_db, self._on_remap = env, gate, meta_db, on_remap
        self._dir, self._sync, self._sync_interval_s = config.dir, config.sync, config.sync_interval_s
        self._followups = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="actcache-writer", daemon=True)
        self._stopping = False
        self._dirty_since: float | None = None
        self._thread.start()

    def stop(self) -> None:
        """Commit everything queued so far, then end the thread."""
        self._stopping = True
        self._queue.put(_STOP)
        self._thread.join()

    def submit(self, op: WriteOp) -> Any:
        if self._stopping:
            raise StoreError("the daemon is shutting down; retry against the restarted daemon")
        self._gate.check()
        self._queue.put(op)
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result_value

    def _run(self) -> None:
        while True:
            try:
                op = self._queue.get(timeout=self._sync_interval_s)
            except queue.Empty:
                self._periodic_sync()
                continue
            batch, nbytes = [], 0
            while op is not _STOP:
                batch.append(op)
                nbytes += op.nbytes
                if len(batch) >= _MAX_OPS_PER_TXN or nbytes >= _MAX_BYTES_PER_TXN:
                    break
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._commit(batch)
                self._periodic_sync()
            if op is _STOP:
                return

    def _periodic_sync(self) -> None:
        if self._sync or self._dirty_since is None or self._gate.broken:
            return
        if time.monotonic() - self._dirty_since >= self._sync_interval_s:
            self._env.sync(True)
            self._dirty_since = None

    def _commit(self, batch: list[WriteOp]) -> None:
        error = self._attempt(batch)
        if error is None:
            return
        # A full disk: commit the ops one by one, so that drops and small writes still go through.
        singly = len(batch) > 1 and isinstance(error, BudgetExceeded)
        for op in batch:
            op_error = self._attempt([op]) if singly else error
            if op_error is not None:
                op.finish(error=op_error)

    def _attempt(self, batch: list[WriteOp]) -> ActCacheError | None:
        """Commit ``batch`` in one transaction and finish its ops; on failure return the error
        (the ops are left unfinished for the caller)."""
        needed = sum(op.nbytes for op in batch)
        for _ in range(_MAX_GROWTHS_PER_BATCH):
            if self._gate.broken:
                return StoreError(self._gate.broken)
            pending: dict[bytes, list[int]] = {}
            outcomes: list[tuple[Any, ActCacheError | None]] = []
            try:
                with self._env.begin(write=True, buffers=True) as txn:
                    for op in batch:
                        try:
                            outcomes.append((op.apply(txn, pending), None))
                        except ActCacheError as exc:
                            outcomes.append((None, exc))
            except lmdb.MapFullError:
                error = self._grow(needed)
                if error is not None:
                    return error
                continue
            except _DAMAGE as exc:
                return damaged(self._dir, "a write", exc)
            except lmdb.Error as exc:  # a short write on a full disk surfaces as EIO: the free space decides
                nospace = getattr(exc, "errno", None) == errno.ENOSPC or "No space" in str(exc)
                if nospace or isinstance(exc, lmdb.DiskError) or free_bytes(self._dir) < needed + _DISK_FULL_SLACK:
                    return _disk_full(self._dir, needed)
                return StoreError(f"LMDB write failed in {self._dir}: {exc}")
            except BaseException as exc:  # a bug: wake every caller rather than stall them
                log.exception("write transaction failed")
                return StoreError(f"write failed unexpectedly: {exc!r}")
            break
        else:
            return StoreError(
                f"the LMDB map was still full after {_MAX_GROWTHS_PER_BATCH} growths for a {needed}-byte batch")
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()
        freed = False
        for op, (result, error) in zip(batch, outcomes):
            if error is None:
                op.result_value = result
                op.publish(pending)
                freed = freed or op.frees_pages
            op.finish(result, error)
        if freed:  # one small commit makes the pages just freed reusable (see module doc)
            self._followups += 1
            try:
                with self._env.begin(write=True) as txn:
                    txn.put(b"followup_commits", struct.pack(">Q", self._followups), db=self._meta_db)
            except lmdb.Error as exc:
                log.warning("follow-up commit after freeing pages failed (%s); freed pages are reused one "
                            "commit later", exc)
        return None

    def _grow(self, needed: int) -> ActCacheError | None:
        """Double the map (add 64 GiB above 64 GiB); return the error that prevents it, if any."""
        old = self._env.info()["map_size"]
        new = old * 2 if old < 64 << 30 else old + (64 << 30)
        if free_bytes(self._dir) < needed:
            return _disk_full(self._dir, needed)
        try:
            probe = mmap.mmap(-1, new - old, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, prot=0)
        except (OSError, OverflowError, ValueError) as exc:
            return BudgetExceeded(
                f"the LMDB map is full at {old} bytes and cannot grow to {new} bytes: the process cannot map "
                f"{new - old} more bytes ({exc}); raise the address-space limit (ulimit -v), drop entries with "
                "`actcache drop`, or lower --budget. Reads keep working")
        probe.close()
        with self._gate.exclusive():
            try:
                self._env.set_mapsize(new)
            except lmdb.Error as exc:
                self._gate.broken = (f"growing the LMDB map from {old} to {new} bytes failed ({exc}) and left the "
                                     "store unusable; restart the daemon")
                log.critical("%s", self._gate.broken)
                return StoreError(self._gate.broken)
            finally:
                self._on_remap()
        log.info("LMDB map full at %d bytes; grew it to %d bytes", old, new)
        return None


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged process may still write on the file system holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _disk_full(path: str | os.PathLike[str], needed: int) -> BudgetExceeded:
    st = os.statvfs(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return BudgetExceeded(
        f"the disk holding {path} is full: {free} bytes free of {total} "
        f"({format_size(free)} of {format_size(total)}) and this write needs about {needed} bytes; "
        "free space on that file system or run `actcache drop`. Reads keep working")
