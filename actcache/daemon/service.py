"""The ActCache gRPC service: request validation and translation onto the Store.

Every handler turns an ActCacheError into its gRPC status (actcache.errors)
and any other exception into INTERNAL with a log line; nothing a client
sends can take the daemon down.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable, Iterator

import grpc

from actcache import __version__
from actcache._proto import actcache_pb2 as pb
from actcache.daemon.store import Store
from actcache.daemon.throttle import Throttle
from actcache.errors import ActCacheError, EntryCorrupt, InvalidRequest, status_of
from actcache.rpc import SERVICE, decode_frame, encode_frame, split_payload

__all__ = ["ActCacheService", "Counters"]

log = logging.getLogger(__name__)

# Entries are packed into reply frames of about this many bytes.
_REPLY_FRAME_BYTES = 4 << 20
_MAX_IDS_PER_GET = 1 << 20
# Keys looked up per store read (each read also stops at _REPLY_FRAME_BYTES of values).
_IDS_PER_READ = 4096


@dataclass
class Counters:
    """Totals since the daemon started (exported by Stats)."""

    puts_total: int = 0
    put_bytes_total: int = 0
    gets_total: int = 0
    hits_total: int = 0
    misses_total: int = 0
    served_bytes_total: int = 0
    corrupt_total: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}


def _status_on_error(handler: Callable) -> Callable:
    @functools.wraps(handler)
    def wrapper(self, request, context):
        try:
            return handler(self, request, context)
        except ActCacheError as exc:
            context.abort(status_of(exc), str(exc))
        except Exception as exc:
            log.exception("%s failed", handler.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{handler.__name__} failed in the daemon: {exc!r}")

    return wrapper


def _stream_status_on_error(handler: Callable) -> Callable:
    @functools.wraps(handler)
    def wrapper(self, request, context):
        try:
            yield from handler(self, request, context)
        except ActCacheError as exc:
            context.abort(status_of(exc), str(exc))
        except Exception as exc:
            log.exception("%s failed", handler.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{handler.__name__} failed in the daemon: {exc!r}")

    return wrapper


def _variants(variants, count: int) -> list[int]:
    if not variants:
        return [0] * count
    if len(variants) != count:
        raise InvalidRequest(f"{len(variants)} variants for {count} sample ids; send one per id or none")
    return list(variants)


class ActCacheService:
    """Handlers of the ActCache service over one Store."""

    def __init__(self, store: Store, *, max_message_bytes: int, throttle: Throttle | None = None) -> None:
        self.store = store
        self.throttle = throttle
        self.max_message_bytes = max_message_bytes
        self.counters = Counters()
        self.started = time.monotonic()

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler registering every method with its (de)serializers."""
        raw = lambda x: x  # noqa: E731  bulk methods: frames are parsed by hand
        unary = grpc.unary_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Open": unary(self.Open, pb.OpenRequest.FromString, pb.OpenReply.SerializeToString),
                "Drop": unary(self.Drop, pb.DropRequest.FromString, pb.DropReply.SerializeToString),
                "Stats": unary(self.Stats, pb.StatsRequest.FromString, pb.StatsReply.SerializeToString),
                "Put": grpc.stream_unary_rpc_method_handler(self.Put, raw, pb.PutReply.SerializeToString),
                "Get": grpc.unary_stream_rpc_method_handler(self.Get, pb.GetRequest.FromString, raw),
                "Schedule": grpc.stream_unary_rpc_method_handler(
                    self.Schedule, pb.ScheduleChunk.FromString, pb.ScheduleReply.SerializeToString
                ),
                "Fetch": grpc.unary_stream_rpc_method_handler(self.Fetch, pb.FetchRequest.FromString, raw),
            },
        )

    @_status_on_error
    def Open(self, request: pb.OpenRequest, context) -> pb.OpenReply:
        info = self.store.open_namespace(request.name, create=request.create, secret=request.secret)
        cfg = self.store.config
        return pb.OpenReply(
            namespace_id=info.handle,
            namespace_budget_bytes=cfg.namespace_budget_bytes,
            daemon_budget_bytes=cfg.budget_bytes,
            max_message_bytes=self.max_message_bytes,
            max_entry_bytes=cfg.max_entry_bytes,
            server_version=__version__,
        )

    @_status_on_error
    def Put(self, frames: Iterator[bytes], context) -> pb.PutReply:
        reply = pb.PutReply()
        for frame in frames:
            header_bytes, payload = decode_frame(frame)
            try:
                header = pb.PutHeader.FromString(header_bytes)
            except Exception as exc:
                raise InvalidRequest(f"Put frame header does not parse as PutHeader: {exc}") from None
            if len(header.lengths) != len(header.sample_ids):
                raise InvalidRequest(f"PutHeader lists {len(header.sample_ids)} sample ids but {len(header.lengths)} lengths")
            variants = _variants(header.variants, len(header.sample_ids))
            values = split_payload(payload, header.lengths)
            result = self.store.put(
                header.namespace_id, header.fingerprint, header.depth, list(zip(header.sample_ids, variants, values))
            )
            reply.entries += result.entries
            reply.stored_bytes += result.stored_bytes
            reply.replaced += result.replaced
            self.counters.add(puts_total=result.entries, put_bytes_total=len(payload))
        return reply

    @_stream_status_on_error
    def Get(self, request: pb.GetRequest, context) -> Iterator[bytes]:
        """Streams the entries in request order, reading one reply frame's worth at a time
        (memory stays near ``_REPLY_FRAME_BYTES`` per call, whatever the number of ids)."""
        count = len(request.sample_ids)
        if count > _MAX_IDS_PER_GET:
            raise InvalidRequest(f"Get asks for {count} entries; at most {_MAX_IDS_PER_GET} per call")
        variants = request.variants
        if variants and len(variants) != count:
            raise InvalidRequest(f"{len(variants)} variants for {count} sample ids; send one per id or none")
        self.counters.add(gets_total=1)
        start = 0
        while True:
            ids = request.sample_ids[start : start + _IDS_PER_READ]
            keys = list(zip(ids, variants[start : start + _IDS_PER_READ] if variants else [0] * len(ids)))
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
            header = pb.EntriesHeader(
                start=start,
                sample_ids=request.sample_ids[start:stop],
                variants=variants[start:stop] if variants else [],
                lengths=[len(v or b"") for v in values],
            )
            self.counters.add(hits_total=hits, misses_total=len(values) - hits, served_bytes_total=size)
            if self.throttle is not None:
                self.throttle.consume(size)
            yield encode_frame(header.SerializeToString(), [v for v in values if v])
            if stop >= count:
                break
            start = stop

    def Schedule(self, chunks, context) -> pb.ScheduleReply:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Schedule is not available in this daemon version; use Get")

    def Fetch(self, request, context) -> Iterator[bytes]:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Fetch is not available in this daemon version; use Get")
        yield b""  # pragma: no cover  (makes this a generator)

    @_status_on_error
    def Drop(self, request: pb.DropRequest, context) -> pb.DropReply:
        fingerprint = request.fingerprint or None
        depth = request.depth if request.HasField("depth") else None
        entries, nbytes = self.store.drop(request.namespace_id, fingerprint, depth)
        return pb.DropReply(entries=entries, bytes=nbytes)

    @_status_on_error
    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        store = self.store
        names = {}
        reply = pb.StatsReply(
            used_bytes=store.used_bytes(),
            budget_bytes=store.config.budget_bytes,
            map_size_bytes=store.map_size(),
            file_bytes=store.file_bytes(),
            uptime_seconds=time.monotonic() - self.started,
            server_version=__version__,
            **self.counters.snapshot(),
        )
        for info, entries, nbytes in store.namespaces():
            names[info.id] = info.name
            reply.namespaces.add(
                name=info.name, namespace_id=info.id, entries=entries, bytes=nbytes,
                budget_bytes=store.config.namespace_budget_bytes,
            )
        for group in store.groups():
            reply.groups.add(
                namespace=names.get(group.namespace_id, str(group.namespace_id)),
                fingerprint=group.fingerprint,
                depth=group.depth,
                entries=group.entries,
                bytes=group.bytes,
            )
        return reply
