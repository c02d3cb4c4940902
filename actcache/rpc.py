"""The wire layer shared by daemon and clients: method names, Frame encoding, entry packing.

A ``Frame`` (proto/actcache.proto) is ``{bytes header = 1; bytes payload = 2}``. Bulk methods build and
parse it by hand (byte-compatible with the generated stubs): payloads are joined once, sliced on receipt.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

from actcache.errors import InvalidRequest, VersionMismatch

__all__ = ["PROTOCOL_VERSION", "SERVICE", "decode_frame", "encode_frame", "method", "split_payload", "version_mismatch"]

SERVICE = "actcache.v1.ActCache"

#: The wire protocol client and daemon speak, exchanged at Open; raise it with any change that one
#: side of another version cannot serve (0 on the wire: a peer older than the exchange).
PROTOCOL_VERSION = 1


def version_mismatch(client_version: str, client_protocol: int, daemon_version: str,
                     daemon_protocol: int) -> VersionMismatch:
    """The one error for a client and a daemon that speak different protocols (raised on either side)."""

    def side(version: str, protocol: int) -> str:
        return f"{version or 'unknown'} (wire protocol {protocol or 'unknown: older than the version check'})"

    return VersionMismatch(
        f"actcache client {side(client_version, client_protocol)} and node daemon "
        f"{side(daemon_version, daemon_protocol)} cannot serve each other; restart the node daemon: "
        "run `actcache stop` (with the job's --socket, if it sets one), and the next connect() starts a current one"
    )


def method(name: str) -> str:
    """Full gRPC path of a method of the ActCache service."""
    return f"/{SERVICE}/{name}"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_frame(header: bytes, payload_parts: Iterable[bytes | memoryview]) -> bytes:
    """Serialize a Frame whose payload is the concatenation of ``payload_parts`` (one copy)."""
    parts = list(payload_parts)
    size = sum(memoryview(p).nbytes for p in parts)
    head = b"\x0a" + _varint(len(header)) + header
    if size:
        head += b"\x12" + _varint(size)
    return b"".join([head, *parts])


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(view) and shift < 64:
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise InvalidRequest("frame is truncated or malformed (bad varint)")


def decode_frame(buf: bytes | memoryview) -> tuple[memoryview, memoryview]:
    """Return (header, payload) views of a serialized Frame; raises InvalidRequest if malformed."""
    view = memoryview(buf)
    fields = {1: view[:0], 2: view[:0]}
    pos = 0
    while pos < len(view):
        tag, pos = _read_varint(view, pos)
        number, wire_type = tag >> 3, tag & 7
        if number not in fields or wire_type != 2:
            raise InvalidRequest(f"frame has unexpected field {number} (wire type {wire_type})")
        length, pos = _read_varint(view, pos)
        if pos + length > len(view):
            raise InvalidRequest(f"frame field {number} declares {length} bytes but {len(view) - pos} remain")
        fields[number] = view[pos : pos + length]
        pos += length
    return fields[1], fields[2]


def split_payload(payload: memoryview, lengths: Sequence[int]) -> list[memoryview]:
    """Slice a frame payload into entries of the given lengths (0 = a miss, an empty view)."""
    total = sum(lengths)
    if total != len(payload):
        raise InvalidRequest(f"frame header lists {total} payload bytes but the payload has {len(payload)}")
    return [payload[end - n : end] for n, end in zip(lengths, itertools.accumulate(lengths))]
