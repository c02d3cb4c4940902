"""The ActCache gRPC service: request validation and translation onto the Store. Every handler turns an
ActCacheError into its gRPC status and any other exception into INTERNAL with a log line."""

from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc
import numpy as np

from actcache import __version__
from actcache._proto import actcache_pb2 as pb
from actcache.codec import Encoding, encode_batch, unpack_layout
from actcache.daemon._tally import Tally
from actcache.daemon.prefetch import Prefetcher, ScheduleBuilder, unpack_ids, unpack_variants
from actcache.daemon.service._shm_fetch import ParkedRings, Throttle, serve_fetch
from actcache.daemon.service._stats import NamespaceJobs, stats_reply
from actcache.daemon.store import Store
from actcache.errors import ERROR_METADATA_KEY, ActCacheError, EntryCorrupt, InvalidRequest, StoreError, status_of
from actcache.rpc import PROTOCOL_VERSION, SERVICE, decode_frame, encode_frame, split_payload, version_mismatch
from actcache.shm import HEADER_BYTES, MAX_RING_BYTES, ShmRing, column_starts

__all__ = ["ActCacheService", "Counters"]

log = logging.getLogger(__name__)

# Entries are packed into reply frames of about this many bytes.
_REPLY_FRAME_BYTES = 4 << 20
_MAX_IDS_PER_GET = 1 << 20
# Keys looked up per store read (each read also stops at _REPLY_FRAME_BYTES of values).
_IDS_PER_READ = 4096


@dataclass
class Counters(Tally):
    """Totals since the daemon started (exported by Stats)."""

    puts_total: int = 0
    put_bytes_total: int = 0
    gets_total: int = 0
    hits_total: int = 0
    misses_total: int = 0
    served_bytes_total: int = 0
    corrupt_total: int = 0
    #: Shared-memory rings made for Fetch calls, and Fetch calls served in a parked ring of their client.
    rings_created_total: int = 0
    rings_reused_total: int = 0
    #: Shared-memory segments made for PutShared calls.
    put_segments_total: int = 0


def _abort(context, name: str, exc: Exception) -> None:
    if isinstance(exc, grpc.RpcError) and not context.is_active():  # the client cancelled mid-request
        log.debug("%s: the client cancelled the call", name)
        context.abort(grpc.StatusCode.CANCELLED, f"{name} was cancelled by the client")
    if isinstance(exc, ActCacheError):
        context.set_trailing_metadata(((ERROR_METADATA_KEY, type(exc).__name__),))
        context.abort(status_of(exc), str(exc))
    log.error("%s failed", name, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"{name} failed in the daemon: {exc!r}")


def _status_on_error(handler: Callable) -> Callable:
    """The handler (a generator for a response stream), with its errors turned into statuses by ``_abort``."""
    if inspect.isgeneratorfunction(handler):

        @functools.wraps(handler)
        def stream(self, request, context):
            try:
                yield from handler(self, request, context)
            except Exception as exc:
                _abort(context, handler.__name__, exc)

        return stream

    @functools.wraps(handler)
    def unary(self, request, context):
        try:
            return handler(self, request, context)
        except Exception as exc:
            _abort(context, handler.__name__, exc)

    return unary


def _variants(variants, count: int) -> list[int]:
    if not variants:
        return [0] * count
    if len(variants) != count:
        raise InvalidRequest(f"{len(variants)} variants for {count} sample ids; send one per id or none")
    return list(variants)


def _segment_bytes(segment: ShmRing, offset: int, size: int) -> memoryview:
    """The ``size`` bytes at ``offset`` of ``segment``'s data area; InvalidRequest if they are not all in it."""
    if offset + size > segment.capacity:
        raise InvalidRequest(f"a PutShared frame names {size} bytes at offset {offset} of a {segment.capacity}-byte "
                             "segment")
    return segment.view(HEADER_BYTES + offset, size)


def _put_header(data: memoryview) -> pb.PutHeader:
    try:
        return pb.PutHeader.FromString(data)
    except Exception as exc:
        raise InvalidRequest(f"Put frame header does not parse as PutHeader: {exc}") from None


@functools.lru_cache(maxsize=64)
def _encoding(text: str) -> Encoding | None:
    """A PutHeader's encoding ("" = the daemon's own); raises InvalidRequest naming the valid ones."""
    if not text:
        return None
    try:
        return Encoding.parse(text)
    except InvalidRequest as exc:
        raise InvalidRequest(f"PutHeader.encoding: {exc}") from None


class ActCacheService:
    """Handlers of the ActCache service over one Store."""

    def __init__(
        self, store: Store, prefetcher: Prefetcher, *, max_message_bytes: int, throttle: Throttle | None = None
    ) -> None:
        self.store = store
        self.prefetcher = prefetcher
        self.throttle = throttle
        self.max_message_bytes = max_message_bytes
        self.counters = Counters()
        self.started = time.monotonic()
        #: Jobs that opened each namespace (OpenRequest.job), for Stats.
        self.jobs = NamespaceJobs()
        #: Shared-memory rings of ended streams, kept for their clients' next Fetch.
        self.rings = ParkedRings()

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler registering every method with its (de)serializers."""
        raw = None  # bulk methods: frames are parsed by hand
        unary, stream_unary = grpc.unary_unary_rpc_method_handler, grpc.stream_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Open": unary(self.Open, pb.OpenRequest.FromString, pb.OpenReply.SerializeToString),
            "Contains": unary(self.Contains, pb.ContainsRequest.FromString, pb.ContainsReply.SerializeToString),
            "Drop": unary(self.Drop, pb.DropRequest.FromString, pb.DropReply.SerializeToString),
            "Stats": unary(self.Stats, pb.StatsRequest.FromString, pb.StatsReply.SerializeToString),
            "Put": stream_unary(self.Put, raw, pb.PutReply.SerializeToString),
            "PutShared": grpc.stream_stream_rpc_method_handler(self.PutShared, raw, pb.PutReply.SerializeToString),
            "Get": grpc.unary_stream_rpc_method_handler(self.Get, pb.GetRequest.FromString, raw),
            "Schedule": stream_unary(self.Schedule, pb.ScheduleChunk.FromString, pb.ScheduleReply.SerializeToString),
            "Fetch": grpc.unary_stream_rpc_method_handler(self.Fetch, pb.FetchRequest.FromString, raw),
        })

    @_status_on_error
    def Open(self, request: pb.OpenRequest, context) -> pb.OpenReply:
        if request.protocol_version != PROTOCOL_VERSION:  # 0: a client older than the exchange
            raise version_mismatch(request.client_version[:64], request.protocol_version, __version__, PROTOCOL_VERSION)
        info = self.store.open_namespace(request.name, create=request.create, secret=request.secret)
        if request.HasField("job"):
            job = request.job
            self.jobs.record(info.id, pid=job.pid, host=job.host, start_time=job.start_time, data_id=job.data_id)
        cfg = self.store.config
        return pb.OpenReply(
            namespace_id=info.handle, namespace_budget_bytes=cfg.namespace_budget_bytes,
            daemon_budget_bytes=cfg.budget_bytes, max_message_bytes=self.max_message_bytes,
            max_entry_bytes=cfg.max_entry_bytes, server_version=__version__, protocol_version=PROTOCOL_VERSION,
        )

    @_status_on_error
    def Put(self, frames: Iterator[bytes], context) -> pb.PutReply:
        reply = pb.PutReply()
        for frame in frames:
            header_bytes, payload = decode_frame(frame)
            result = self._put_frame(_put_header(header_bytes), payload)
            reply.entries += result.entries
            reply.stored_bytes += result.stored_bytes
            reply.replaced += result.replaced
        return reply

    @_status_on_error
    def PutShared(self, frames: Iterator[bytes], context) -> Iterator[pb.PutReply]:
        """Put through a segment made for this call: each frame's entries are read where it says they lie."""
        if not context.peer().startswith("unix:"):
            raise InvalidRequest(f"PutShared needs a client on this host's Unix socket, not {context.peer()}; use Put")
        first = next(frames, None)
        if first is None:
            return
        asked = _put_header(decode_frame(first)[0]).segment_bytes
        if not 0 < asked <= MAX_RING_BYTES:
            raise InvalidRequest(f"PutShared's first frame asks for a segment of {asked} bytes; ask for 1..{MAX_RING_BYTES}")
        try:
            segment = ShmRing(asked, 0)
        except OSError as exc:
            raise StoreError(f"shared memory unavailable for a PutShared segment: {exc}; puts go in messages (Put)") \
                from None
        context.add_callback(segment.unlink)  # a client gone before mapping leaves no name behind
        self.counters.add(put_segments_total=1)
        try:
            yield pb.PutReply(segment=str(segment.path))
            for frame in frames:
                segment.poll()  # the client has mapped it by now: the name goes
                header_bytes, payload = decode_frame(frame)
                header = _put_header(header_bytes)
                if len(payload):
                    raise InvalidRequest(f"a PutShared frame carries {len(payload)} bytes itself; its entries lie in "
                                         "the segment")
                yield (self._put_columns(header, segment) if header.layout
                       else self._put_frame(header, _segment_bytes(segment, header.segment_offset, sum(header.lengths))))
        finally:
            segment.close()

    def _put_columns(self, header: pb.PutHeader, segment: ShmRing) -> pb.PutReply:
        """Encode and store the entries of a frame of tensor columns (``PutHeader.layout``)."""
        specs = unpack_layout(header.layout)
        ids = unpack_ids((), header.packed_sample_ids)
        variants = unpack_variants((), header.packed_variants, len(ids))
        sizes = [spec.nbytes for spec in specs]
        starts = column_starts(sizes, len(ids), header.segment_offset, segment.capacity)
        if starts is None:
            raise InvalidRequest(f"{len(ids)} samples of {sum(sizes)} bytes from offset {header.segment_offset} do not "
                                 f"fit a {segment.capacity}-byte segment")
        columns = [np.frombuffer(_segment_bytes(segment, at, len(ids) * n), np.uint8).reshape(len(ids), n)
                   for at, n in zip(starts, sizes)]
        rows = encode_batch(specs, columns)
        result = self.store.put_rows(header.namespace_id, header.fingerprint, header.depth, ids, variants, rows,
                                     encoding=_encoding(header.encoding))
        self.counters.add(puts_total=result.entries, put_bytes_total=rows.nbytes)
        return pb.PutReply(entries=result.entries, stored_bytes=result.stored_bytes, replaced=result.replaced)

    def _put_frame(self, header: pb.PutHeader, payload: memoryview) -> pb.PutReply:
        """Store one Put frame's entries (``payload``: their bytes, back to back)."""
        if len(header.lengths) != len(header.sample_ids):
            raise InvalidRequest(f"PutHeader lists {len(header.sample_ids)} sample ids but {len(header.lengths)} lengths")
        variants = _variants(header.variants, len(header.sample_ids))
        values = split_payload(payload, header.lengths)
        result = self.store.put(
            header.namespace_id, header.fingerprint, header.depth, list(zip(header.sample_ids, variants, values)),
            encoding=_encoding(header.encoding),
        )
        self.counters.add(puts_total=result.entries, put_bytes_total=len(payload))
        return pb.PutReply(entries=result.entries, stored_bytes=result.stored_bytes, replaced=result.replaced)

    @_status_on_error
    def Get(self, request: pb.GetRequest, context) -> Iterator[bytes]:
        """Streams the entries in request order, reading one reply frame's worth at a time (bounded memory)."""
        count = len(request.sample_ids)
        if count > _MAX_IDS_PER_GET:
            raise InvalidRequest(f"Get asks for {count} entries; at most {_MAX_IDS_PER_GET} per call")
        variants = _variants(request.variants, count)
        self.counters.add(gets_total=1)
        start = 0
        while True:
            keys = list(zip(request.sample_ids[start : start + _IDS_PER_READ], variants[start : start + _IDS_PER_READ]))
            try:
                values = self.store.get(
                    request.namespace_id, request.fingerprint, request.depth, keys, max_bytes=_REPLY_FRAME_BYTES
                )
            except EntryCorrupt:
                self.counters.add(corrupt_total=1)
                raise
            stop = start + len(values)
            hits = sum(v is not None for v in values)
            size = sum(len(v) for v in values if v is not None)
            header = pb.EntriesHeader(start=start, sample_ids=request.sample_ids[start:stop],
                                      variants=request.variants[start:stop], lengths=[len(v or b"") for v in values])
            self.counters.add(hits_total=hits, misses_total=len(values) - hits, served_bytes_total=size)
            if self.throttle is not None:
                self.throttle.consume(size)
            yield encode_frame(header.SerializeToString(), [v for v in values if v])
            if stop >= count:
                break
            start = stop

    @_status_on_error
    def Schedule(self, chunks: Iterator[pb.ScheduleChunk], context) -> pb.ScheduleReply:
        builder = ScheduleBuilder()
        resolved: dict[int, int] = {}  # handle -> namespace id (protected namespaces have random handles)
        report = None  # the first chunk's namespace handle, when it asks which entries are stored
        for chunk in chunks:
            if not resolved and chunk.report_present:
                report = chunk.namespace_id
            ids = unpack_ids(chunk.sample_ids, chunk.packed_sample_ids)
            variants = unpack_variants(chunk.variants, chunk.packed_variants, len(ids))
            if chunk.namespace_id not in resolved:  # 0 in a later chunk: not repeated; in the first: no namespace
                first = not resolved
                resolved[chunk.namespace_id] = self.store.resolve(chunk.namespace_id) if chunk.namespace_id or first else 0
            builder.add(resolved[chunk.namespace_id], chunk.fingerprint, chunk.depth, chunk.schedule_id, ids, variants)
        # gRPC ends the request stream alike on a half-close and a cancel mid-upload; asking for one more
        # message raises after a cancel, so a truncated upload is never pushed.
        for _ in chunks:
            raise InvalidRequest("the Schedule stream went on after its end")
        schedule = builder.build()
        present = b"" if report is None else bytes(self.store.contains(
            report, schedule.fingerprint, schedule.depth, schedule.sample_ids, schedule.variants))
        # nothing stored yet (an epoch that writes): nothing to read ahead; a Fetch of it reads what it asks for
        replaced = self.prefetcher.push(schedule, read_ahead=report is None or any(present))
        return pb.ScheduleReply(schedule_id=schedule.schedule_id, length=len(schedule), replaced=replaced,
                                present=present)

    @_status_on_error
    def Fetch(self, request: pb.FetchRequest, context) -> Iterator[bytes]:
        reader = self.prefetcher.attach(self.store.resolve(request.namespace_id), request.schedule_id, request.start)
        # Fires when the call ends for any reason; a consumer that went away frees its memory at once.
        context.add_callback(reader.cancel)
        frame_bytes = min(request.max_frame_bytes or _REPLY_FRAME_BYTES, self.max_message_bytes // 2)
        try:
            detail = yield from serve_fetch(request, context, self.rings, reader, frame_bytes, self.throttle,
                                            self.counters.add)
            if detail is None:
                return
            for i, frame in enumerate(reader.frames(frame_bytes)):
                if i == 0 and request.shared_memory:  # say why the bytes path was taken
                    header_bytes, payload = decode_frame(frame)
                    header = pb.EntriesHeader.FromString(header_bytes)
                    header.data_plane, header.data_plane_detail = "bytes", detail
                    frame = encode_frame(header.SerializeToString(), [payload])
                if self.throttle is not None:
                    self.throttle.consume(len(frame))
                yield frame
        finally:
            reader.cancel()

    @_status_on_error
    def Contains(self, request: pb.ContainsRequest, context) -> pb.ContainsReply:
        ids = unpack_ids((), request.packed_sample_ids)
        if len(ids) > _MAX_IDS_PER_GET:
            raise InvalidRequest(f"Contains asks about {len(ids)} entries; at most {_MAX_IDS_PER_GET} per call")
        variants = unpack_variants((), request.packed_variants, len(ids))
        present = self.store.contains(request.namespace_id, request.fingerprint, request.depth, ids, variants)
        return pb.ContainsReply(present=bytes(present))

    @_status_on_error
    def Drop(self, request: pb.DropRequest, context) -> pb.DropReply:
        fingerprint = request.fingerprint or None
        depth = request.depth if request.HasField("depth") else None
        entries, nbytes = self.store.drop(request.namespace_id, fingerprint, depth)
        return pb.DropReply(entries=entries, bytes=nbytes)

    @_status_on_error
    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        return stats_reply(self.store, self.prefetcher, self.jobs, self.counters.snapshot(),
                           time.monotonic() - self.started)
