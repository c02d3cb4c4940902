"""The store's single writer thread: batches queued write operations into one LMDB transaction.

Invariants: exactly one thread writes; an operation's caller is woken with
its result or its exception, never left waiting; the map grows (doubling)
when LMDB reports it full, while no read transaction is open in the process.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import lmdb

from actcache.errors import ActCacheError, BudgetExceeded, StoreError

__all__ = ["ReadGate", "WriteOp", "Writer"]

log = logging.getLogger(__name__)

_MAX_OPS_PER_TXN = 512
_MAX_BYTES_PER_TXN = 64 << 20


class ReadGate:
    """Lets readers in concurrently and a map resize in alone.

    LMDB allows ``set_mapsize`` only while the process has no open
    transaction, so readers hold the gate while their transaction is open.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._exclusive = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._readers += 1
        try:
            yield
        finally:
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
    """One queued write. ``apply`` must raise before its first write or not at all
    (LMDB errors excepted: they abort and retry or fail the whole transaction)."""

    nbytes: int = 0

    def __init__(self) -> None:
        self._done = threading.Event()
        self.result_value: Any = None
        self.error: BaseException | None = None

    def apply(self, txn: lmdb.Transaction, pending: dict[bytes, list[int]]) -> Any:
        raise NotImplementedError

    def publish(self, pending: dict[bytes, list[int]]) -> None:
        """Make the committed effects visible in memory (called after commit)."""

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result_value, self.error = result, error
        self._done.set()

    def wait(self) -> Any:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.result_value


_STOP = object()


class Writer:
    """Runs queued WriteOps in batches on one thread; ``submit`` blocks until committed."""

    def __init__(self, env: lmdb.Environment, gate: ReadGate, *, sync: bool, sync_interval_s: float) -> None:
        self._env = env
        self._gate = gate
        self._sync = sync
        self._sync_interval_s = sync_interval_s
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="actcache-writer", daemon=True)
        self._stopping = False
        self._dirty_since: float | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Commit everything queued so far, then end the thread."""
        self._stopping = True
        self._queue.put(_STOP)
        self._thread.join()

    def submit(self, op: WriteOp) -> Any:
        if self._stopping:
            raise StoreError("the daemon is shutting down; retry against the restarted daemon")
        self._queue.put(op)
        return op.wait()

    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=self._sync_interval_s)
            except queue.Empty:
                self._periodic_sync()
                continue
            if first is _STOP:
                return
            batch, nbytes, stop = [first], first.nbytes, False
            while len(batch) < _MAX_OPS_PER_TXN and nbytes < _MAX_BYTES_PER_TXN:
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
                if op is _STOP:
                    stop = True
                    break
                batch.append(op)
                nbytes += op.nbytes
            self._commit(batch)
            self._periodic_sync()
            if stop:
                return

    def _periodic_sync(self) -> None:
        if self._sync or self._dirty_since is None:
            return
        if time.monotonic() - self._dirty_since >= self._sync_interval_s:
            self._env.sync(True)
            self._dirty_since = None

    def _commit(self, batch: list[WriteOp]) -> None:
        while True:
            pending: dict[bytes, list[int]] = {}
            outcomes: list[tuple[Any, BaseException | None]] = []
            try:
                with self._env.begin(write=True) as txn:
                    for op in batch:
                        try:
                            outcomes.append((op.apply(txn, pending), None))
                        except ActCacheError as exc:
                            outcomes.append((None, exc))
            except lmdb.MapFullError:
                self._grow()
                continue
            except lmdb.Error as exc:
                error = _storage_error(exc, self._env.path())
                for op in batch:
                    op.finish(error=error)
                return
            except BaseException as exc:  # a bug: wake every caller rather than stall them
                log.exception("write transaction failed")
                for op in batch:
                    op.finish(error=StoreError(f"write failed unexpectedly: {exc!r}"))
                return
            break
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()
        for op, (result, error) in zip(batch, outcomes):
            if error is None:
                op.result_value = result
                op.publish(pending)
            op.finish(result, error)

    def _grow(self) -> None:
        old = self._env.info()["map_size"]
        new = old * 2 if old < 64 << 30 else old + (64 << 30)
        with self._gate.exclusive():
            self._env.set_mapsize(new)
        log.info("LMDB map full at %d bytes; grew it to %d bytes", old, new)


def _storage_error(exc: lmdb.Error, path: str) -> ActCacheError:
    if isinstance(exc, lmdb.DiskError) or getattr(exc, "errno", None) == errno.ENOSPC or "No space" in str(exc):
        st = os.statvfs(path)
        return BudgetExceeded(
            f"the disk holding {path} is full ({st.f_bavail * st.f_frsize} bytes free of "
            f"{st.f_blocks * st.f_frsize}); free space or run `actcache drop`. Reads keep working"
        )
    return StoreError(f"LMDB write failed in {path}: {exc}")
