"""The client's side of PutShared: entries put through a shared-memory segment instead of the gRPC message.

A stream is one PutShared call and the segment the daemon made for it (``actcache.shm``'s layout, its
header unused). Each put copies its entries, or a batch's tensors as columns that the daemon encodes into
entries, into the segment's data area with numpy (which releases the GIL, so a put beside a training step
costs that step little) and sends a frame of metadata; the reply says they are committed, and only then is
the area written again. Over gRPC the same bytes are copied three more times in this process (the frame,
gRPC's message, the socket) while holding the GIL.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from actcache._proto import actcache_pb2 as pb
from actcache.codec import TensorSpec, pack_layout
from actcache.errors import DaemonUnavailable, error_of
from actcache.rpc import encode_frame
from actcache.shm import HEADER_BYTES, ClientSegment, column_starts

__all__ = ["PutStream"]


class _Deadline:
    """Cancels a call whose reply is awaited past its deadline; one thread, waking four times a timeout."""

    def __init__(self, cancel: Callable[[], object], timeout_s: float) -> None:
        self._cancel, self.timeout_s = cancel, timeout_s
        self._cond = threading.Condition()
        self._due: float | None = None
        self._closed = False
        self.fired = False
        threading.Thread(target=self._watch, name="actcache-put-deadline", daemon=True).start()

    def arm(self) -> None:
        with self._cond:
            self._due = time.monotonic() + self.timeout_s

    def disarm(self) -> None:
        with self._cond:
            self._due = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._due is not None and time.monotonic() >= self._due:
                    self.fired, self._due = True, None
                    self._cancel()
                self._cond.wait(self.timeout_s / 4)


class PutStream:
    """One PutShared call and its segment; used by one thread at a time.

    Args:
        call: The PutShared method of a channel (stream-stream, replies parsed as PutReply).
        segment_bytes: The size of the segment to ask for.
        timeout_s: How long a reply may take before the call is cancelled (DaemonUnavailable).
        metadata: The call's metadata (a token).

    Raises:
        ActCacheError: The daemon refused the call (UNIMPLEMENTED by an older daemon, a client not on its
            Unix socket) or did not answer.
        OSError: The segment could not be mapped (the daemon runs as another user).
    """

    def __init__(self, call: Callable, segment_bytes: int, timeout_s: float,
                 metadata: list[tuple[str, str]] | None = None) -> None:
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._replies = call(iter(self._requests.get, None), metadata=metadata)
        self._deadline = _Deadline(self._replies.cancel, timeout_s)
        self.broken = False
        self._segment: ClientSegment | None = None
        try:
            reply = self._send(pb.PutHeader(segment_bytes=segment_bytes))
            self._segment = ClientSegment(reply.segment)
        except BaseException:
            self.close()
            raise
        #: The data area: puts of up to ``capacity`` bytes fit.
        self._data = np.frombuffer(self._segment.view, np.uint8, offset=HEADER_BYTES)
        self.capacity = len(self._data)

    def put(self, namespace_id: int, fingerprint: bytes, depth: int,
            items: Sequence[tuple[int, int, bytes | memoryview]], encoding: str = "") -> pb.PutReply:
        """Store ``(sample_id, variant, encoded entry)`` items (at most ``capacity`` bytes); returns once
        they are committed."""
        at = 0
        for _, _, value in items:
            n = len(value)
            self._data[at : at + n] = np.frombuffer(value, np.uint8)
            at += n
        return self._send(pb.PutHeader(
            namespace_id=namespace_id, fingerprint=fingerprint, depth=depth, encoding=encoding,
            sample_ids=[s for s, _, _ in items], lengths=[len(v) for _, _, v in items],
            variants=[v for _, v, _ in items] if any(v for _, v, _ in items) else [], segment_offset=0,
        ))

    def put_columns(self, namespace_id: int, fingerprint: bytes, depth: int, sample_ids: np.ndarray,
                    variants: np.ndarray | None, specs: Sequence[TensorSpec], parts: Sequence[Sequence[np.ndarray]],
                    encoding: str = "") -> pb.PutReply | None:
        """Store the samples ``sample_ids`` (uint64), given in parts of consecutive samples (``parts[k][j]``:
        tensor j of the k-th part's samples, a ``(samples, bytes)`` uint8 array); the daemon encodes their
        entries. None (nothing sent) if they do not fit."""
        starts = column_starts([spec.nbytes for spec in specs], len(sample_ids), 0, self.capacity)
        if starts is None:
            return None
        for j, at in enumerate(starts):  # each part's rows after the part before
            for part in parts:
                block = part[j]
                self._data[at : at + block.nbytes] = block.reshape(-1)
                at += block.nbytes
        return self._send(pb.PutHeader(
            namespace_id=namespace_id, fingerprint=fingerprint, depth=depth, encoding=encoding,
            layout=pack_layout(specs), packed_sample_ids=sample_ids.tobytes(),
            packed_variants=variants.tobytes() if variants is not None else b"", segment_offset=0,
        ))

    def _send(self, header: pb.PutHeader) -> pb.PutReply:
        self._requests.put(encode_frame(header.SerializeToString(), []))
        self._deadline.arm()
        try:
            return next(self._replies)
        except grpc.RpcError as exc:
            self.broken = True
            if self._deadline.fired:
                raise DaemonUnavailable(f"a shared-memory put was not answered within {self._deadline.timeout_s:g} s; "
                                        "is the daemon overloaded?") from None
            raise error_of(exc) from None
        except StopIteration:
            self.broken = True
            raise DaemonUnavailable("the daemon ended the shared-memory put stream") from None
        finally:
            self._deadline.disarm()

    def close(self) -> None:
        """End the call and drop the mapping."""
        self.broken = True
        self._requests.put(None)
        self._deadline.close()
        self._replies.cancel()
        self._data = np.empty(0, np.uint8)  # the mapping goes once no array views it
        if self._segment is not None:
            self._segment.close()
