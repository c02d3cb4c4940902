"""A torch-free client of the daemon: one method per RPC, typed errors, deadlines, retries.

The channel is opened lazily in each process (gRPC channels do not survive ``fork``, and
DataLoader workers fork), so one RpcClient may be handed to worker processes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import socket
import threading
import time
from typing import Any, Callable, Generator, Iterator, Sequence

import grpc
import numpy as np

from actcache import __version__, rpc
from actcache._proto import actcache_pb2 as pb
from actcache.codec import TensorSpec
from actcache.entries import ColumnEntry, EntryBatch
from actcache.errors import ActCacheError, DaemonUnavailable, InvalidRequest, error_of
from actcache.keys import MAX_VARIANT, check_fingerprint
from actcache.node import default_socket_path
from actcache.put_stream import PutStream
from actcache.rpc import decode_frame, encode_frame, method
from actcache.shm import COLUMN_ALIGN, MAX_RING_BYTES, ClientSegment, SegmentPool, ShmRing

__all__ = ["JobInfo", "RpcClient", "target_for"]

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
_FRAME_BYTES = 8 << 20
_SCHEDULE_CHUNK_IDS = 1 << 16
# The smallest PutShared segment (a put larger than half of it asks for one of twice its size).
_PUT_SEGMENT_BYTES = 8 << 20

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class JobInfo:
    """A job as it describes itself at Open (``actcache ls`` lists them); ``current()`` is this process."""

    pid: int
    host: str
    #: When the process started, wall clock seconds since the epoch.
    start_time: float
    #: What data the job reads (e.g. IndexedDataset's data_id); may be empty.
    data_id: str = ""

    @classmethod
    def current(cls, data_id: str = "") -> "JobInfo":
        return cls(os.getpid(), socket.gethostname(), _process_start_time(), data_id)


@functools.cache
def _process_start_time() -> float:
    """This process's start (wall clock), from /proc on Linux; elsewhere the first time this is asked."""
    try:
        with open("/proc/self/stat") as f:  # field 22 (after the parenthesised name): start in clock ticks
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def target_for(socket: str | os.PathLike | None = None, address: str | None = None) -> str:
    """gRPC target for a Unix socket path or a ``HOST:PORT`` address."""
    return address or f"unix:{os.fspath(default_socket_path() if socket is None else socket)}"


class RpcClient:
    """Calls the ActCache service. Every call has a deadline; UNAVAILABLE is retried with backoff."""

    def __init__(
        self, target: str, *, token: str | None = None, timeout_s: float = 30.0, retries: int = 3,
        max_message_bytes: int = 128 << 20, root_certificates: bytes | None = None, shared_puts: bool = False,
    ) -> None:
        """``shared_puts``: over a Unix socket, put entries through a shared-memory segment (``PutStream``); the
        stream holds a daemon thread until ``end_put_stream`` or ``close``."""
        self.target = target
        self.timeout_s = timeout_s
        self.retries = retries
        self._token = token
        self._root_certificates = root_certificates
        self._max_message_bytes = max_message_bytes
        self._lock = threading.Lock()
        #: Shared-memory segments of ended Fetches, offered to the next one (see actcache.shm, "Reuse").
        self.segments = SegmentPool()
        self._pid: int | None = None
        #: Why puts travel in gRPC messages ("": they go through shared memory when the target allows).
        self.put_plane_detail = ("shared_puts=False" if not shared_puts else
                                 "" if target.startswith("unix:") else f"{target} is not a Unix socket")
        self._put_stream: tuple[PutStream, int] | None = None  # and the pid of the process that opened it
        self._put_lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._calls: dict[str, Callable] = {}

    def _channel_and_calls(self) -> tuple[grpc.Channel, dict[str, Callable]]:
        """This process's channel and its methods, opened on first use in each process."""
        with self._lock:
            if self._pid == os.getpid():
                return self._channel, self._calls
            options = [
                ("grpc.max_send_message_length", self._max_message_bytes),
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.enable_retries", 0),
                # gRPC's default reconnect backoff grows to 120 s; the Connection backs off on its own
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ]
            if self._root_certificates is not None:
                creds = grpc.ssl_channel_credentials(self._root_certificates)
                channel = grpc.secure_channel(self.target, creds, options)
            else:
                channel = grpc.insecure_channel(self.target, options)
            # None: bulk frames, passed as bytes and parsed by hand
            kinds: dict[str, tuple[str, Any, Any]] = {
                "Open": ("unary_unary", pb.OpenRequest, pb.OpenReply),
                "Contains": ("unary_unary", pb.ContainsRequest, pb.ContainsReply),
                "Drop": ("unary_unary", pb.DropRequest, pb.DropReply),
                "Stats": ("unary_unary", pb.StatsRequest, pb.StatsReply),
                "Put": ("stream_unary", None, pb.PutReply),
                "PutShared": ("stream_stream", None, pb.PutReply),
                "Get": ("unary_stream", pb.GetRequest, None),
                "Schedule": ("stream_unary", pb.ScheduleChunk, pb.ScheduleReply),
                "Fetch": ("unary_stream", pb.FetchRequest, None),
            }
            self._calls = {
                name: getattr(channel, kind)(method(name), request_serializer=req and req.SerializeToString,
                                             response_deserializer=rep and rep.FromString)
                for name, (kind, req, rep) in kinds.items()
            }
            self._channel, self._pid = channel, os.getpid()
            return channel, self._calls

    def _call(self, name: str) -> Callable:
        return self._channel_and_calls()[1][name]

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the channel is connected (retrying every 0.1 s to 1 s); False if not within ``timeout_s``."""
        ready = grpc.channel_ready_future(self._channel_and_calls()[0])
        try:
            ready.result(timeout=timeout_s)
            return True
        except grpc.FutureTimeoutError:
            ready.cancel()
            return False

    def end_put_stream(self) -> None:
        """End this process's shared-memory put stream, if any (the next put opens another)."""
        with self._put_lock:
            if self._put_stream is not None and self._put_stream[1] == os.getpid():
                self._put_stream[0].close()
            self._put_stream = None

    def close(self) -> None:
        self.end_put_stream()
        with self._lock:
            if self._channel is not None and self._pid == os.getpid():
                self._channel.close()
            self._channel, self._pid, self._calls = None, None, {}
        self.segments.clear()

    def __enter__(self) -> "RpcClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _metadata(self) -> list[tuple[str, str]] | None:
        return [("authorization", f"Bearer {self._token}")] if self._token else None

    def _rpc(self, name: str, request, then: Callable | None = None):
        """``then`` of the reply of method ``name`` to ``request`` (a message, or a function making the request
        stream anew per try), within the deadline, retrying UNAVAILABLE with jittered backoff."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.05
        for attempt in range(self.retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                reply = self._call(name)(request() if callable(request) else request, timeout=remaining,
                                         metadata=self._metadata())
                return then(reply) if then else reply
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE or attempt == self.retries:
                    raise error_of(exc) from None
            time.sleep(min(delay * (1 + random.random()), max(0.0, deadline - time.monotonic())))
            delay *= 2
        raise DaemonUnavailable(f"daemon at {self.target} did not answer within {self.timeout_s:.1f} s; "
                                "is `actcache serve` running?")

    def open(
        self, name: str, *, create: bool = True, secret: bytes | str | None = None, job: JobInfo | None = None
    ) -> pb.OpenReply:
        """Open (or create) a namespace; returns its handle (valid until the daemon restarts) and limits.

        A ``secret`` protects the namespace: only Opens presenting it get the handle. ``job`` tells the
        daemon who opens it. Raises VersionMismatch when the daemon speaks another wire protocol.
        """
        if isinstance(secret, str):
            secret = secret.encode()
        request = pb.OpenRequest(name=name, create=create, secret=secret or b"",
                                 job=pb.JobInfo(**dataclasses.asdict(job)) if job is not None else None,
                                 client_version=__version__, protocol_version=rpc.PROTOCOL_VERSION)
        reply = self._rpc("Open", request)
        if reply.protocol_version != rpc.PROTOCOL_VERSION:
            raise rpc.version_mismatch(__version__, rpc.PROTOCOL_VERSION, reply.server_version, reply.protocol_version)
        return reply

    def put(
        self, namespace_id: int, fingerprint: bytes, depth: int, items: Sequence[tuple[int, int, bytes | memoryview]],
        *, encoding: str = "", frame_bytes: int = _FRAME_BYTES,
    ) -> pb.PutReply:
        """Store ``(sample_id, variant, encoded entry)`` items; returns once they are committed.
        ``encoding`` ("" = the daemon's own): how the daemon stores the raw ones (PutHeader.encoding).
        Through shared memory when the daemon is on this host's Unix socket (``put_plane_detail``)."""
        fingerprint = check_fingerprint(fingerprint)
        shared = self._through_segment(sum(len(v) for _, _, v in items),
                                       lambda stream: stream.put(namespace_id, fingerprint, depth, items, encoding))
        if shared is not None:
            return shared

        def frames() -> Iterator[bytes]:
            start, size = 0, 0
            for i, (_, _, value) in enumerate(items):
                size += len(value)
                if size >= frame_bytes or i == len(items) - 1:
                    chunk = items[start : i + 1]
                    header = pb.PutHeader(
                        namespace_id=namespace_id, fingerprint=fingerprint, depth=depth, encoding=encoding,
                        sample_ids=[s for s, _, _ in chunk], lengths=[len(v) for _, _, v in chunk],
                        variants=[v for _, v, _ in chunk] if any(v for _, v, _ in chunk) else [],
                    )
                    yield encode_frame(header.SerializeToString(), [v for _, _, v in chunk])
                    start, size = i + 1, 0

        return self._rpc("Put", frames)

    def put_columns(
        self, namespace_id: int, fingerprint: bytes, depth: int, sample_ids: Sequence[int] | np.ndarray,
        variants: Sequence[int] | np.ndarray | None, specs: Sequence[TensorSpec], parts: Sequence[Sequence[np.ndarray]],
        *, encoding: str = "",
    ) -> pb.PutReply | None:
        """Store samples as tensor columns through shared memory (``PutStream.put_columns``): the daemon
        encodes their entries. ``parts[k][j]`` is tensor j of the k-th run of consecutive samples, a
        ``(samples, bytes)`` uint8 array. None when puts cannot go through shared memory (``put_plane_detail``)
        or the stream broke: then encode the entries and ``put`` them."""
        if self.put_plane_detail:
            return None  # before the checks: a TCP client never lays out columns
        fingerprint = check_fingerprint(fingerprint)
        ids, vars_ = _ids_and_variants(sample_ids, variants)
        if any(len(part) != len(specs) or any(a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != s.nbytes
                                               for a, s in zip(part, specs)) for part in parts) \
                or any(sum(len(part[j]) for part in parts) != len(ids) for j in range(len(specs))):
            shapes = [[(a.dtype.name, a.shape) for a in part] for part in parts]
            raise InvalidRequest(f"tensor parts {shapes} are not one uint8 row of {[s.nbytes for s in specs]} bytes "
                                 f"per sample of the {len(ids)}")
        return self._through_segment(
            sum(a.nbytes for part in parts for a in part) + COLUMN_ALIGN * len(specs),
            lambda stream: stream.put_columns(namespace_id, fingerprint, depth, ids, vars_, specs, parts, encoding))

    def _through_segment(self, nbytes: int, send: Callable[[PutStream], pb.PutReply | None]) -> pb.PutReply | None:
        """``send`` on this process's put stream, with room for ``nbytes``; None when puts go in messages
        (``put_plane_detail``) or the stream broke (a daemon restarting: a Put retries within the deadline)."""
        if self.put_plane_detail:
            return None
        with self._put_lock:
            try:
                stream = self._shared_put_stream(nbytes)
                return send(stream) if stream is not None else None
            except DaemonUnavailable as exc:
                log.info("actcache: the shared-memory put stream broke (%s); this put goes in a message", exc)
                return None

    def _shared_put_stream(self, nbytes: int) -> PutStream | None:
        """This process's PutShared stream with room for ``nbytes`` (opened anew when broken or too small); None
        when puts must travel in messages: then ``put_plane_detail`` says why (an older daemon, a daemon of
        another user, an entry larger than the largest segment)."""
        if self._put_stream is not None:
            stream, pid = self._put_stream
            if pid == os.getpid() and not stream.broken and stream.capacity >= nbytes:
                return stream
            if pid == os.getpid():
                stream.close()
            self._put_stream = None
        if nbytes > MAX_RING_BYTES:
            return None  # this put only: a later, smaller one uses a segment
        size = max(_PUT_SEGMENT_BYTES, 1 << (2 * nbytes - 1).bit_length())
        try:
            stream = PutStream(self._call("PutShared"), min(size, MAX_RING_BYTES), self.timeout_s, self._metadata())
        except DaemonUnavailable:
            raise  # the daemon is down, not the data plane
        except (ActCacheError, OSError) as exc:
            self.put_plane_detail = f"shared memory unavailable: {exc}"
            log.info("actcache: puts travel in gRPC messages (%s)", self.put_plane_detail)
            return None
        self._put_stream = stream, os.getpid()
        return stream

    def get(
        self, namespace_id: int, fingerprint: bytes, depth: int, sample_ids: Sequence[int],
        variants: Sequence[int] | None = None,
    ) -> list[memoryview | None]:
        """Look up entries in order; a miss is None."""
        request = pb.GetRequest(namespace_id=namespace_id, fingerprint=check_fingerprint(fingerprint), depth=depth,
                                sample_ids=list(sample_ids), variants=list(variants or []))
        result = self._rpc("Get", request, lambda frames: [v for f in frames for v in EntryBatch.from_frame(f).values])
        if len(result) != len(sample_ids):
            raise ActCacheError(f"daemon answered {len(result)} entries for {len(sample_ids)} requested")
        return result

    def schedule(
        self, namespace_id: int, fingerprint: bytes, depth: int, schedule_id: str,
        sample_ids: Sequence[int] | np.ndarray, variants: Sequence[int] | np.ndarray | None = None,
        *, chunk_ids: int = _SCHEDULE_CHUNK_IDS, report_present: bool = False,
    ) -> pb.ScheduleReply:
        """Push an order of sample ids as schedule ``schedule_id`` (replacing one of that id); the daemon
        reads it ahead at once. ``report_present``: the reply's ``present`` says which entries are stored."""
        fingerprint = check_fingerprint(fingerprint)
        ids, vars_ = _ids_and_variants(sample_ids, variants)
        if chunk_ids < 1:
            raise InvalidRequest(f"chunk_ids must be >= 1, got {chunk_ids}")

        def chunks() -> Iterator[pb.ScheduleChunk]:
            for start in range(0, max(1, len(ids)), chunk_ids):
                chunk = pb.ScheduleChunk(packed_sample_ids=ids[start : start + chunk_ids].tobytes())
                if vars_ is not None:
                    chunk.packed_variants = vars_[start : start + chunk_ids].tobytes()
                if start == 0:
                    chunk.namespace_id, chunk.fingerprint = namespace_id, fingerprint
                    chunk.depth, chunk.schedule_id = depth, schedule_id
                    chunk.report_present = report_present
                yield chunk

        return self._rpc("Schedule", chunks)

    def fetch_batches(
        self, namespace_id: int, schedule_id: str, start: int = 0, *, max_frame_bytes: int = 0,
        shared_memory: bool = False, ring_bytes: int = 0, whole_frames: bool = False, columns: bool = False,
    ) -> Generator[EntryBatch, None, None]:
        """Stream a pushed schedule from position ``start``, one EntryBatch per frame, without a deadline;
        resumes after UNAVAILABLE up to ``retries`` times. Closing the iterator cancels the call.

        ``shared_memory`` (Unix socket only): values are views into a ring of ``ring_bytes`` (0 = 8 MiB),
        valid until the next batch is asked for, unless the caller holds them (``ClientSegment.hold`` on
        ``EntryBatch.columns.segment``): asking for the next batch releases the ring up to the first
        position held. ``whole_frames``: frames are never cut short. ``columns``: frames of columns where
        the daemon can (``EntryBatch.columns``). A segment still held when the stream ends is dropped, never
        reused: it is unmapped once its holders and views are gone.
        """
        position, attempt = start, 0
        use_shm = shared_memory and self.target.startswith("unix:")
        while True:
            offered = self.segments.take(ShmRing.size_for(ring_bytes)) if use_shm else None
            request = pb.FetchRequest(
                namespace_id=namespace_id, schedule_id=schedule_id, start=position, max_frame_bytes=max_frame_bytes,
                shared_memory=use_shm, ring_bytes=ring_bytes, reuse_segment=offered.path if offered else "",
                whole_frames=whole_frames, columns=columns and use_shm,
            )
            call = self._call("Fetch")(request, metadata=self._metadata())
            segment = None
            try:
                frames = iter(call)
                while True:
                    if segment is not None:  # the daemon sends it in the payload if the ring is full
                        segment.waiting(position)
                    frame = next(frames, None)
                    if frame is None:
                        return
                    header_bytes, payload = decode_frame(frame)
                    header = pb.EntriesHeader.FromString(header_bytes)
                    if header.segment:
                        if offered is not None and header.segment == offered.path:
                            segment, offered = offered, None
                        else:
                            try:
                                segment = ClientSegment(header.segment)
                            except OSError:  # e.g. another mount namespace: ask again for bytes
                                use_shm = False
                                break
                    batch = (EntryBatch.from_slots(header, segment, payload) if segment is not None
                             else EntryBatch.from_bytes(header, payload))
                    if batch.start != position:
                        raise ActCacheError(f"Fetch frame starts at position {batch.start}, expected {position}")
                    position += len(batch)
                    attempt = 0
                    yield batch
                    if segment is not None:  # consumed: release before waiting for more
                        segment.release(position)
                continue  # the segment could not be mapped: fall back to the bytes path from `position`
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE or attempt >= self.retries:
                    raise error_of(exc) from None
            finally:
                call.cancel()
                if offered is not None:  # the daemon no longer had it
                    offered.close()
                # a segment with views alive is dropped, never written again: unmapped once they all go
                if segment is not None and not segment.held():  # the daemon parks the ring once the call has ended
                    self.segments.put(segment)
            attempt += 1
            time.sleep(0.05 * 2**attempt * (1 + random.random()))

    def fetch(
        self, namespace_id: int, schedule_id: str, start: int = 0, *, max_frame_bytes: int = 0,
        shared_memory: bool = False, ring_bytes: int = 0,
    ) -> Iterator[tuple[int, int, int, memoryview | ColumnEntry | None]]:
        """Like ``fetch_batches`` but one ``(position, sample_id, variant, value or None)`` per entry."""
        for batch in self.fetch_batches(namespace_id, schedule_id, start, max_frame_bytes=max_frame_bytes,
                                        shared_memory=shared_memory, ring_bytes=ring_bytes):
            yield from batch

    def contains(
        self, namespace_id: int, fingerprint: bytes, depth: int, sample_ids: Sequence[int] | np.ndarray,
        variants: Sequence[int] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Which entries are stored (a bool array parallel to ``sample_ids``), without reading their values."""
        fingerprint = check_fingerprint(fingerprint)
        ids, vars_ = _ids_and_variants(sample_ids, variants)
        request = pb.ContainsRequest(namespace_id=namespace_id, fingerprint=fingerprint, depth=depth,
                                     packed_sample_ids=ids.tobytes(),
                                     packed_variants=b"" if vars_ is None else vars_.tobytes())
        return np.frombuffer(self._rpc("Contains", request).present, np.uint8).astype(bool)

    def drop(self, namespace_id: int, fingerprint: bytes | None = None, depth: int | None = None) -> pb.DropReply:
        """Delete a namespace's entries, optionally only one fingerprint (and depth)."""
        request = pb.DropRequest(namespace_id=namespace_id, fingerprint=fingerprint or b"", depth=depth)
        return self._rpc("Drop", request)

    def stats(self) -> pb.StatsReply:
        return self._rpc("Stats", pb.StatsRequest())


def _ids_and_variants(sample_ids, variants) -> tuple[np.ndarray, np.ndarray | None]:
    """Sample ids as little-endian uint64 and variants as uint16 (None: all 0), checked to be one per id."""
    ids = _as_array(sample_ids, "<u8", "sample id", 2**64 - 1)
    if variants is None:
        return ids, None
    vars_ = _as_array(variants, "<u2", "variant", MAX_VARIANT)
    if len(vars_) != len(ids):
        raise InvalidRequest(f"{len(vars_)} variants for {len(ids)} sample ids; pass one per id or none")
    return ids, vars_


def _as_array(values, dtype, what: str, limit: int) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise InvalidRequest(f"{what}s must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "ui":
        raise InvalidRequest(f"{what}s must be integers, got dtype {array.dtype}")
    if array.size and array.min() < 0:
        raise InvalidRequest(f"{what} {int(array.min())} is negative; the range is 0..{limit}")
    if array.size and int(array.max()) > limit:
        raise InvalidRequest(f"{what} {int(array.max())} is out of range 0..{limit}")
    return array.astype(dtype, copy=False)

