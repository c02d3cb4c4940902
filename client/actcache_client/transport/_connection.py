"""The training side's connection to a daemon: lookups, asynchronous puts, fallback on trouble.

The cache is an optimization, never a dependency. When the daemon is down, slow, full or returns a corrupt
entry, ``lookup`` answers None (recompute everything) and puts are dropped; each cause warns once
(CacheFallbackWarning), then is logged at most every ``log_every_s``. After a failure to reach the daemon,
calls are skipped for a back-off interval (1 s doubling to 30 s), so a dead daemon costs training only the
first timeout. ``strict=True`` raises the ActCacheError instead (for tests), after waiting up to ``timeout_s``
for a daemon it cannot reach (one restarting).

Puts run on one background thread fed by a bounded queue: ``store`` never blocks the training step; a put
finding the queue full is dropped and counted. The put thread, the fallback state and the calls share the
connection's state under one lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Generator, Protocol, Sequence, TypeVar

from actcache.codec import raw_entry_bytes
from actcache.entries import EntryBatch
from actcache.errors import (
    ActCacheError,
    BudgetExceeded,
    ConfigError,
    DaemonUnavailable,
    EntryCorrupt,
    LifecycleError,
    NamespaceNotFound,
)
from actcache.rpc_client import JobInfo, RpcClient, target_for
from actcache_client.transport._put_group import Columns, Encode, Encoding, PutGathering, PutGroup

if TYPE_CHECKING:
    import numpy as np

    from actcache.codec import TensorSpec

__all__ = ["CacheFallbackWarning", "ClientStats", "Connection", "ConnectionConfig", "Lease", "connected"]

log = logging.getLogger("actcache_client")

# Seconds without a put after which the put stream (and the daemon thread serving it) is ended; an idle
# writer thread wakes this often, no more (a process may hold many connections).
_PUT_STREAM_IDLE_S = 2.0
# Puts of tensor columns are gathered up to this many bytes, then queued as one; the writer thread queues
# what was gathered once no store has added to it for this long (an epoch's last batches).
_GROUP_BYTES = 4 << 20
_GROUP_LINGER_S = 0.05

T = TypeVar("T")


def _nothing() -> None:
    """A job that only wakes the writer thread."""


class Lease(Protocol):
    """What a connection stops when it closes: a daemon of its own, or its lease on the node daemon. A lease
    with a ``revive()`` method (the node daemon's) is told when a call finds the daemon unreachable."""

    def stop(self) -> None: ...


class CacheFallbackWarning(RuntimeWarning):
    """The cache could not be used for a step; training recomputed instead."""


@dataclass(frozen=True, kw_only=True)
class ConnectionConfig:
    """How to reach the daemon and how to behave when it misbehaves.

    Attributes:
        socket: The daemon's Unix socket.
        address: The daemon's network address (instead of ``socket``).
        token: The daemon's access token.
        namespace: The namespace this job's entries live in.
        secret: Protects the namespace: only jobs presenting the same secret can use it.
        strict: Raise instead of falling back to recomputation (after waiting up to timeout_s for an
            unreachable daemon).
        timeout_s: Deadline of one lookup or put, retries included.
        put_queue: Puts waiting for the background writer; more are dropped.
        log_every_s: After its first warning, each fallback cause is logged at most this often.
        backoff_s: After the daemon was unreachable or full, skip it for this long (doubling up to 30 s).

    Raises:
        ConfigError: ``timeout_s`` is not positive or ``put_queue`` is below 1.
    """

    socket: str | None = None
    address: str | None = None
    token: str | None = field(default=None, repr=False)
    namespace: str = "default"
    #: Protects the namespace: only jobs presenting the same secret can use it.
    secret: str | None = field(default=None, repr=False)
    #: Raise instead of falling back to recomputation (after waiting up to timeout_s for an unreachable daemon).
    strict: bool = False
    #: Deadline of one lookup or put, retries included.
    timeout_s: float = 10.0
    #: Puts waiting for the background writer; more are dropped.
    put_queue: int = 16
    log_every_s: float = 60.0
    #: After the daemon was unreachable or full, skip it for this long (doubling up to 30 s).
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.put_queue < 1:
            raise ConfigError(f"put_queue must be >= 1, got {self.put_queue}")


@dataclass
class ClientStats:
    """What the cache did for this process, in entries (one per sample and depth) unless named otherwise.

    ``hits + misses`` is every entry asked for, through a stream (``streamed`` of them) or through ``Get``
    calls (``gets``: seeds from a shallower depth, batches no stream served). ``fetch_seconds`` is the time
    spent waiting for either. ``puts`` counts entries stored; ``puts_dropped`` puts not sent. ``timed_bytes``
    over ``timed_seconds`` is the read speed the step gets (the cost model's fetch speed): Get calls, timed
    whole, and the stream's frames the step waited for, as the one before, timed from that one's arrival (a
    frame already there when asked only shows that the stream kept up). ``received_bytes`` over
    ``received_seconds`` is the rate the step received the stream's frames at, waits and overlap with its
    own work together (each frame over the time since the one before): a floor for the fetch speed.
    ``waited_bytes`` over ``waited_seconds``: the stream's frames the step waited for, over those waits: the
    stream was still reading them, so a ceiling.

    Attributes:
        gets: Entries asked for through ``Get`` calls.
        streamed: Entries asked for through a stream.
        hits: Entries found.
        misses: Entries not found.
        bytes_read: Bytes of the entries read.
        fetch_seconds: Time spent waiting for entries (stream or Get).
        timed_bytes: Bytes of the read-speed samples.
        timed_seconds: Seconds of the read-speed samples.
        received_bytes: Bytes of the stream's frames, for the rate they were received at.
        received_seconds: Seconds since each such frame's predecessor arrived.
        waited_bytes: Bytes of the stream's frames the step waited for.
        waited_seconds: Seconds the step waited for them.
        puts: Entries stored.
        bytes_written: Bytes of the entries stored.
        write_seconds: Time the puts took.
        puts_dropped: Puts not sent.
        dropped_entries: Entries of superseded or mismatching fingerprints this process dropped in the daemon.
        inline_entries: Stream entries sent in messages on the shared-memory plane: larger than the ring, or
            the ring full of batches the step still uses (each then copied out of its message).
        fallbacks: Fallbacks to recomputation, per cause.
    """

    gets: int = 0
    streamed: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    fetch_seconds: float = 0.0
    timed_bytes: int = 0
    timed_seconds: float = 0.0
    received_bytes: int = 0
    received_seconds: float = 0.0
    waited_bytes: int = 0
    waited_seconds: float = 0.0
    puts: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    puts_dropped: int = 0
    #: Entries of superseded or mismatching fingerprints this process dropped in the daemon.
    dropped_entries: int = 0
    inline_entries: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


# Bytes a read-speed probe reads back: enough to time, little enough not to crowd out lookups.
_PROBE_BYTES = 1 << 20
# The step waited for a frame if it waited this share of the time since the previous frame arrived.
_WAITED = 0.25


class Connection:
    """A namespace on a daemon, used by CachedForward; safe to share between threads.

    Args:
        config: How to reach the daemon and how to behave when it misbehaves.
        embedded: A daemon (or the node daemon's lease) that the connection stops when it closes.
    """

    def __init__(self, config: ConnectionConfig, *, embedded: Lease | None = None) -> None:
        self.config = config
        self.stats = ClientStats()
        self._embedded = embedded
        self._rpc = RpcClient(target_for(config.socket, config.address), token=config.token,
                              timeout_s=config.timeout_s, retries=2, shared_puts=True)
        self._lock = threading.Lock()
        self._namespace_id: int | None = None
        self._data_id = ""
        #: How many times the namespace was opened (a new daemon, or the daemon restarted).
        self.opens = 0
        #: How many times the daemon came back after it was gone (``resume``): what was pushed before is gone.
        self.resumes = 0
        self._last_log: dict[str, float] = {}  # per cause: when it was last logged (first: warned)
        self._paused_until = 0.0
        self._backoff_s = config.backoff_s
        self._put_errors: list[ActCacheError] = []
        self._pending_warnings: list[str] = []
        self._queue: queue.Queue = queue.Queue(maxsize=config.put_queue)
        self._gathered = PutGathering(_GROUP_BYTES, _GROUP_LINGER_S)  # puts of columns, not queued yet
        self._writer = threading.Thread(target=self._write_loop, name="actcache-put", daemon=True)
        self._writer.start()
        self._closed = False

    @property
    def target(self) -> str:
        return self._rpc.target

    @property
    def streams_shared_memory(self) -> bool:
        """Whether streams come over shared memory (the daemon is on this host's Unix socket): a ``Get``,
        which does not, then times another data path than the stream's."""
        return self._rpc.target.startswith("unix:")

    def rpc(self) -> RpcClient:
        """The underlying RPC client (for tools; training code does not need it)."""
        return self._rpc

    def lookup(self, fingerprint: bytes, depth: int, ids: Sequence[int], variants: Sequence[int]) -> list | None:
        """Entries for ``ids`` (None per miss), or None when the cache is unusable right now.

        Args:
            fingerprint: The entries' fingerprint (weights and data of the stages before ``depth``).
            depth: The number of stages whose output the entries hold.
            ids: The sample ids.
            variants: Each sample's augmented version.
        """
        values = self._guarded(self._get, fingerprint, depth, ids, variants)
        if values is not None:
            self._backoff_s = self.config.backoff_s
        return values

    def contains(self, fingerprint: bytes, depth: int, ids: Sequence[int], variant: int) -> list[bool] | None:
        """Which entries are stored (values not read), or None when the cache is unusable right now.

        Args:
            fingerprint: The entries' fingerprint.
            depth: The number of stages whose output the entries hold.
            ids: The sample ids.
            variant: The samples' augmented version.
        """
        variants = [variant] * len(ids) if variant else None
        present = self._guarded(self._call, lambda ns: self._rpc.contains(ns, fingerprint, depth, ids, variants))
        return None if present is None else present.tolist()

    def push(self, fingerprint: bytes, depth: int, schedule_id: str, ids: Sequence[int],
             variants: Sequence[int] | None) -> list[bool] | None:
        """Push an order (Schedule) the daemon reads ahead; which of its entries are stored, or None (unusable).

        Args:
            fingerprint: The entries' fingerprint.
            depth: The number of stages whose output the entries hold.
            schedule_id: Names the order, for ``stream``.
            ids: The sample ids, in the order they will be read.
            variants: Each sample's augmented version (None: all 0).
        """
        reply = self._guarded(self._call, lambda ns: self._rpc.schedule(ns, fingerprint, depth, schedule_id, ids,
                                                                         variants, report_present=True))
        return None if reply is None else list(map(bool, reply.present))

    def _guarded(self, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(*args)``, or None when the cache is paused or the call failed (handed to ``fallback``)."""
        self.surface()
        if self._paused():
            return None
        try:
            return fn(*args)
        except ActCacheError as exc:
            self.fallback(exc)
            return None

    def _get(self, fingerprint: bytes, depth: int, ids: Sequence[int], variants: Sequence[int],
             hits: bool = True) -> list:
        """A Get, timed whole: counted as a read-speed sample, and with ``hits`` as hits and misses."""
        t0 = time.perf_counter()
        values = self._call(lambda ns: self._rpc.get(ns, fingerprint, depth, ids, variants if any(variants) else None))
        seconds = time.perf_counter() - t0
        self._count_read(values, seconds, seconds, gets=1 if hits else 0)
        return values

    def stream(self, schedule_id: str, start: int = 0, *, ring_bytes: int = 0, max_frame_bytes: int = 0,
               ahead: bool = False, columns: bool = False) -> Generator[EntryBatch, None, None]:
        """Fetch a pushed schedule from ``start``: shared memory on a Unix socket of this host, else bytes.

        Counts frames in ``stats``; errors are raised to the caller (who hands them to ``fallback``).

        Args:
            schedule_id: The pushed order.
            start: The batch to start from.
            ring_bytes: The shared-memory ring's size (0: 8 MiB).
            max_frame_bytes: The largest payload of one frame (0: the daemon's default, 4 MiB).
            ahead: Opened before it is used, its first frame counted when it is.
            columns: Ask for frames of columns (``RpcClient.fetch_batches``).

        Yields:
            One batch of entries per frame.
        """
        frames = self._rpc.fetch_batches(self._namespace(), schedule_id, start, shared_memory=True, ring_bytes=ring_bytes,
                                         max_frame_bytes=max_frame_bytes, whole_frames=True, columns=columns)
        counted, last, behind = not ahead, None, False  # last: when the previous frame arrived
        while True:
            t0 = time.perf_counter()
            batch = next(frames, None)
            if batch is None:
                return
            arrived = time.perf_counter()
            # the first frame: asked for as the stream opened, the whole wait is for it
            waited = last is None or arrived - t0 >= _WAITED * (arrived - last)
            if counted:  # waited for this frame and the one before: the stream was reading it all along
                self.count_streamed(batch, arrived - t0, arrived - last if waited and behind and last is not None else None,
                                    received_s=None if last is None else arrived - last, waited=waited)
            counted, last, behind = True, arrived, waited
            try:
                yield batch
            except GeneratorExit:
                frames.close()  # the daemon frees its read-ahead at once
                raise

    def count_streamed(self, batch: EntryBatch, seconds: float, read_s: float | None = None, *,
                       received_s: float | None = None, waited: bool = False) -> None:
        """Count a frame the step takes from a stream and the seconds it waited for it.

        Args:
            batch: The frame's entries.
            seconds: The seconds the step waited for it.
            read_s: The seconds the stream took to read the frame, where known (``timed_*``).
            received_s: The seconds since the frame before arrived (``received_*``).
            waited: The step waited for it: still being read when asked for (``waited_*``).
        """
        self._count_read(batch.values, seconds, read_s, streamed=len(batch.values), received_s=received_s,
                         waited=waited)
        if batch.inline:
            with self._lock:
                self.stats.inline_entries += batch.inline

    def count_absent(self, entries: int) -> None:
        """Count stream entries known to be misses without reading them (the push said none was stored).

        Args:
            entries: How many.
        """
        with self._lock:
            self.stats.streamed += entries
            self.stats.misses += entries

    def _count_read(self, values: Sequence, seconds: float, timed_s: float | None, *, gets: int = 0,
                    streamed: int = 0, received_s: float | None = None, waited: bool = False) -> None:
        """Count entries read in ``seconds``, as hits and misses if asked for; ``timed_s``: as a read-speed sample."""
        found = sum(v is not None for v in values)
        nbytes = sum(len(v) for v in values if v is not None)
        if not nbytes:
            timed_s = seconds  # misses only: a latency
        with self._lock:
            self.stats.fetch_seconds += seconds
            self.stats.bytes_read += nbytes
            if received_s is not None and nbytes:
                self.stats.received_bytes += nbytes
                self.stats.received_seconds += received_s
            if waited and nbytes:
                self.stats.waited_bytes += nbytes
                self.stats.waited_seconds += seconds
            if timed_s is not None:
                self.stats.timed_bytes += nbytes
                self.stats.timed_seconds += timed_s
            if gets or streamed:
                self.stats.gets += gets
                self.stats.streamed += streamed
                self.stats.hits += found
                self.stats.misses += len(values) - found

    def store(self, fingerprint: bytes, depth: int, ids: Sequence[int], variants: Sequence[int],
              encode: Encode, *, probe: bool = False, encoding: Encoding | None = None,
              columns: Columns | None = None, nbytes: int = 0) -> bool:
        """Queue a put; it never blocks the step (a full queue drops it).

        Args:
            fingerprint: The entries' fingerprint.
            depth: The number of stages whose output the entries hold.
            ids: The sample ids.
            variants: Each sample's augmented version.
            encode: Returns the entries' bytes; runs on the writer thread.
            probe: Once stored, read the entries back once to measure the daemon's read speed (counted in
                ``fetch_seconds``/``bytes_read``, not as hits).
            encoding: Given the encoded entries, how the daemon is to store them (``PutHeader.encoding``;
                "" or None: the daemon's ``--encoding``).
            columns: Returns the samples' tensors as columns (``sample_columns``), sent instead of entries
                through shared memory, the daemon encoding them; runs on the writer thread. Only where
                ``encoding`` needs no entries (it was chosen). Such puts of one fingerprint and depth are
                gathered until their tensors reach 4 MiB, then queued as one; ``flush``, ``drop`` and
                ``close`` queue what is gathered first.
            nbytes: The size of the samples' tensors.

        Returns:
            False if the put was dropped.
        """
        self.surface()
        if self._paused():
            self._count_dropped()
            return False
        if columns is None or probe:
            self._submit_group()  # the puts gathered go first
            return self._enqueue(
                partial(self._write, fingerprint, depth, list(ids), list(variants), encode, probe, encoding, None))
        started = not self._gathered.holding()
        for group in self._gathered.add(fingerprint, depth, encoding, ids, variants, encode, columns, nbytes):
            self._enqueue_group(group)
        if started and self._gathered.holding():  # the writer, maybe waiting long, is to time the new group out
            with contextlib.suppress(queue.Full):  # then it is busy anyway
                self._queue.put_nowait(_nothing)
        return True

    def _submit_group(self, *, idle: bool = False) -> bool:
        """Queue the puts gathered (False if there were none); ``idle``: only if no store added to them for a
        while (the writer thread asks)."""
        group = self._gathered.take(idle=idle)
        if group is not None:
            self._enqueue_group(group)
        return group is not None

    def _enqueue_group(self, group: PutGroup) -> None:
        self._enqueue(partial(self._write, group.fingerprint, group.depth, group.ids, group.variants, group.encode,
                              False, group.encoding, group.columns))

    def _enqueue(self, job: Callable[[], None]) -> bool:
        with contextlib.suppress(queue.Full):  # a full queue drops the put: store never blocks the step
            self._queue.put_nowait(job)
            return True
        self._count_dropped()
        return False

    def drop(self, fingerprint: bytes) -> None:
        """Drop every entry of ``fingerprint`` in the daemon, after the puts already queued; never blocks long.

        Args:
            fingerprint: The entries' fingerprint.
        """
        self._submit_group()
        try:
            self._queue.put(partial(self._drop, fingerprint), timeout=self.config.timeout_s)
        except queue.Full:
            log.warning("actcache: could not queue the drop of fingerprint %s: the put queue stayed full",
                        fingerprint.hex())

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued put was sent (or dropped).

        Args:
            timeout_s: The longest wait (None: no limit).
        """
        self._submit_group()
        with self._queue.all_tasks_done:
            self._queue.all_tasks_done.wait_for(lambda: not self._queue.unfinished_tasks, timeout_s)
        self.surface()

    def _write_loop(self) -> None:
        last_job = time.monotonic()
        while True:
            wait = _GROUP_LINGER_S if self._gathered.holding() else _PUT_STREAM_IDLE_S
            try:
                job = self._queue.get(timeout=wait)  # a put or a drop, in the order queued; None: stop
            except queue.Empty:
                # Puts gathered that no store has added to since (an epoch's last batches) are queued, so that
                # they are stored before another rank's next epoch asks which entries are stored.
                if not self._submit_group(idle=True) and time.monotonic() - last_job >= _PUT_STREAM_IDLE_S:
                    self._rpc.end_put_stream()  # between fill epochs: the daemon thread serving it is freed
                continue
            last_job = time.monotonic()
            try:
                if job is None:
                    return
                job()
            except Exception as exc:  # a bug must not stop the writer: the queue would fill and close() wait
                log.error("actcache: a put failed unexpectedly; it is dropped", exc_info=exc)
                self._put_failed(ActCacheError(f"a put failed unexpectedly ({type(exc).__name__}: {exc})"))
            finally:
                self._queue.task_done()

    def _write(self, fingerprint: bytes, depth: int, ids: list[int], variants: list[int], encode: Encode,
               probe: bool, encoding: Encoding | None,
               columns: Callable[[], tuple[list[TensorSpec], list[list[np.ndarray]]] | None] | None) -> None:
        if self._paused():
            self._count_dropped()
            return
        try:
            t0 = time.perf_counter()
            reply, entries = None, None
            laid = columns() if columns is not None else None
            if laid is not None:  # through shared memory, the daemon encoding them (None: it cannot)
                specs, parts = laid
                how = encoding([]) if encoding is not None else ""
                reply = self._call(lambda ns: self._rpc.put_columns(ns, fingerprint, depth, ids, variants, specs,
                                                                    parts, encoding=how))
                written = len(ids) * raw_entry_bytes(specs)
            if reply is None:
                entries = encode()
                how = encoding(entries) if encoding is not None else ""
                t0 = time.perf_counter()
                reply = self._call(lambda ns: self._rpc.put(ns, fingerprint, depth, list(zip(ids, variants, entries)),
                                                            encoding=how))
                written = sum(len(e) for e in entries)
        except ActCacheError as exc:
            self._put_failed(exc)
            return
        with self._lock:
            self.stats.write_seconds += time.perf_counter() - t0
            self.stats.puts += reply.entries
            self.stats.bytes_written += written
        if probe and entries is not None:  # read back about _PROBE_BYTES once, to measure the daemon's read speed
            n = max(1, sum(1 for total in itertools.accumulate(map(len, entries)) if total <= _PROBE_BYTES))
            with contextlib.suppress(ActCacheError):  # a failed probe only means no measurement
                self._get(fingerprint, depth, ids[:n], variants[:n], hits=False)

    def _put_failed(self, exc: ActCacheError) -> None:
        """A put was not stored: counted, and raised on the training thread (strict) or warned of."""
        self._count_dropped()
        if self.config.strict:
            with self._lock:
                self._put_errors.append(exc)
        else:
            self.fallback(exc)

    def _drop(self, fingerprint: bytes) -> None:
        try:
            reply = self._call(lambda ns: self._rpc.drop(ns, fingerprint))
        except ActCacheError as exc:
            log.warning("actcache: dropping fingerprint %s failed (%s); the daemon reclaims it when space is needed",
                        fingerprint.hex(), exc)
            return
        with self._lock:
            self.stats.dropped_entries += reply.entries

    def _count_dropped(self) -> None:
        with self._lock:
            self.stats.puts_dropped += 1

    def surface(self) -> None:
        """On the training thread: emit warnings deferred by background threads, raise strict-mode put errors."""
        if not (self._pending_warnings or self._put_errors):  # read unlocked: one added now surfaces next time
            return
        if threading.current_thread() is not threading.main_thread():
            return
        with self._lock:
            pending, self._pending_warnings = self._pending_warnings, []
            errors, self._put_errors = self._put_errors, []
        for message in pending:
            warnings.warn(message, CacheFallbackWarning, stacklevel=3)
        if errors:
            raise errors[0]

    def describe(self, *, data_id: str) -> None:
        """Name the data this job reads; sent when the namespace is (re)opened.

        Args:
            data_id: The name; the daemon lists it with the job's pid, host and start time
                (``actcache ls``/``stats``).
        """
        if data_id != self._data_id:
            self._data_id = data_id
            self._namespace_id = None  # opened again, with the description, at the next call

    def _namespace(self) -> int:
        if self._namespace_id is None:
            job = JobInfo.current(self._data_id)
            self._namespace_id = self._rpc.open(self.config.namespace, secret=self.config.secret, job=job).namespace_id
            self.opens += 1
        return self._namespace_id

    def _call(self, fn: Callable[[int], T]) -> T:
        """``fn(namespace handle)``, renewing a handle the daemon no longer knows (it restarted) once;
        strict, waiting up to ``timeout_s`` for a daemon that cannot be reached (it is restarting)."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                try:
                    return fn(self._namespace())
                except NamespaceNotFound:
                    self._namespace_id = None
                    return fn(self._namespace())
            except DaemonUnavailable as exc:
                if not self.config.strict:
                    raise
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._rpc.wait_ready(remaining):
                    raise DaemonUnavailable(
                        f"no daemon answered at {self.target} within {self.config.timeout_s:g} s ({exc}); start "
                        "it (`actcache serve`, or connect() without a socket for the node daemon) or raise "
                        "ConnectionConfig.timeout_s") from None

    def _paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def fallback(self, exc: ActCacheError) -> None:
        """Handle a failed cache operation: raise in strict mode, else count, warn once per cause and back off.

        Args:
            exc: The failure.

        Raises:
            ActCacheError: ``exc``, in strict mode.
        """
        if self._closed:  # a call that ``close`` cut short (a stream read ahead for an epoch that never came)
            log.debug("actcache: %s after the connection was closed; ignored", exc)
            return
        if self.config.strict:
            raise exc
        cause = {DaemonUnavailable: "unavailable", BudgetExceeded: "full", EntryCorrupt: "corrupt"}.get(type(exc), "error")
        message = f"actcache: {cause} ({exc}); recomputing instead of using the cache"
        now = time.monotonic()
        with self._lock:
            count = self.stats.fallbacks[cause] = self.stats.fallbacks.get(cause, 0) + 1
            first = cause not in self._last_log
            if first:
                self._pending_warnings.append(message)
            due = first or now - self._last_log[cause] >= self.config.log_every_s
            if due:
                self._last_log[cause] = now
            if cause in ("unavailable", "full"):
                self._paused_until = now + self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, max(30.0, self.config.backoff_s))
        revive = getattr(self._embedded, "revive", None)
        if cause == "unavailable" and callable(revive):
            revive()  # the node daemon's lease starts it again; resume() ends the pause
        if due:
            log.warning("%s [%d times so far]", message, count)
        if first:
            self.surface()

    def resume(self) -> None:
        """The daemon serves again (its lease started it again): once this connection's channel is connected to
        it (gRPC retries a lost connection at its own pace), end the back-off: the next call uses the cache."""
        self._rpc.wait_ready(self.config.timeout_s)
        with self._lock:
            self._paused_until, self._backoff_s = 0.0, self.config.backoff_s
            self.resumes += 1

    def close(self) -> None:
        """Send queued puts, stop the writer thread and an embedded daemon (or the node daemon's lease)."""
        if self._closed:
            return
        self._closed = True
        self._submit_group()
        self._queue.put(None)
        self._writer.join(timeout=self.config.timeout_s * 2)
        self._rpc.close()
        if self._embedded is not None:
            self._embedded.stop()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connected(connection: Connection | None) -> Connection:
    """``connection``, for the parts that run only with one (storing, reading and auditing entries)."""
    if connection is None:
        raise LifecycleError("this model has no connection to a daemon: it stores and reads no entries")
    return connection
