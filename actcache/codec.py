"""Entry encoding: a versioned header plus the (optionally zstd-compressed) tensor bytes.

Layout of one encoded entry (all header integers little-endian)::

    offset  size  field
    0       4     magic b"ACE1"
    4       1     format version (1)
    5       1     codec: 0 raw, 1 zstd, 2 raw_verified (served only, see Codec)
    6       2     number of tensors n
    8       8     raw_len: bytes of the uncompressed payload
    16      8     stored_len: bytes of the payload as stored (after the codec)
    24      4     crc32 of the header (this field excluded) and the stored payload
                  (of the header alone for raw_verified)
    28      ...   per tensor: dtype code (1 B), ndim (1 B), ndim x dim (8 B each)
    ...           zero padding to a multiple of 16 bytes (header_len)
    header_len    stored payload

The raw payload holds the tensors in order, each C-contiguous and starting at
a multiple of 16 bytes, so decoded tensors can be viewed without copies. The
daemon checks the header and checksum of every entry it accepts or serves.
"""

from __future__ import annotations

import enum
import math
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Sequence

from actcache.errors import InvalidRequest

__all__ = [
    "ALIGN",
    "Codec",
    "DType",
    "EntryHeader",
    "TensorSpec",
    "compress_entry",
    "decode_entry",
    "decoded_size",
    "encode_entry",
    "parse_header",
    "to_raw_entries",
    "to_raw_entries_into",
    "to_raw_entry",
    "uniform_layout",
    "verify_entry",
]

MAGIC = b"ACE1"
VERSION = 1
ALIGN = 16
MAX_TENSORS = 64
MAX_NDIM = 16
_FIXED = struct.Struct("<4sBBHQQI")
_CRC_OFFSET = 24
_DIMS_HEAD = struct.Struct("<BB")
# Keep the raw payload when zstd saves less than this share of its bytes.
MIN_SAVING = 0.05


class DType(enum.IntEnum):
    """Element types an entry may hold; the names match torch's dtype names."""

    float32 = 1
    float16 = 2
    bfloat16 = 3
    int64 = 4
    int32 = 5
    uint8 = 6
    bool = 7

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.float32: 4,
    DType.float16: 2,
    DType.bfloat16: 2,
    DType.int64: 8,
    DType.int32: 4,
    DType.uint8: 1,
    DType.bool: 1,
}


class Codec(enum.IntEnum):
    """How the payload is stored. ``raw_verified`` exists only on the serving path: a zstd entry the
    daemon verified and decompressed, whose checksum covers the header alone (a fresh checksum of
    the decompressed bytes would cost a fifth of the serving CPU). Put refuses it."""

    raw = 0
    zstd = 1
    raw_verified = 2


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """dtype and shape of one tensor of an entry."""

    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class EntryHeader:
    """The parsed header of an encoded entry."""

    codec: Codec
    specs: tuple[TensorSpec, ...]
    raw_len: int
    stored_len: int
    crc: int
    header_len: int

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each tensor inside the raw payload."""
        return _offsets(self.specs)[0]

    @property
    def total_len(self) -> int:
        return self.header_len + self.stored_len


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _offsets(specs: Sequence[TensorSpec]) -> tuple[tuple[int, ...], int]:
    offsets, end = [], 0
    for spec in specs:
        start = _align(end)
        offsets.append(start)
        end = start + spec.nbytes
    return tuple(offsets), end


def _pack_header(codec: Codec, specs: Sequence[TensorSpec], raw_len: int, payload: bytes | memoryview) -> bytes:
    """The header of an entry; its checksum covers ``payload`` too unless ``codec`` is raw_verified."""
    parts = [b""]
    for spec in specs:
        parts.append(_DIMS_HEAD.pack(int(spec.dtype), len(spec.shape)))
        parts.append(struct.pack(f"<{len(spec.shape)}Q", *spec.shape))
    dims = b"".join(parts)
    header_len = _align(_FIXED.size + len(dims))
    tail = dims + bytes(header_len - _FIXED.size - len(dims))
    head = _FIXED.pack(MAGIC, VERSION, int(codec), len(specs), raw_len, len(payload), 0)
    crc = zlib.crc32(tail, zlib.crc32(head[:_CRC_OFFSET]))
    if codec != Codec.raw_verified:
        crc = zlib.crc32(payload, crc)
    return head[:_CRC_OFFSET] + struct.pack("<I", crc) + tail


_local = threading.local()


def _compressor(level: int):
    import zstandard

    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor():
    import zstandard

    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor()
    return dctx


def _check_specs(specs: Sequence[TensorSpec]) -> None:
    if not 1 <= len(specs) <= MAX_TENSORS:
        raise InvalidRequest(f"an entry holds 1..{MAX_TENSORS} tensors, got {len(specs)}")
    for i, spec in enumerate(specs):
        if len(spec.shape) > MAX_NDIM or any(d < 0 for d in spec.shape):
            raise InvalidRequest(f"tensor {i}: shape {spec.shape} is invalid (ndim <= {MAX_NDIM}, dims >= 0)")


def encode_entry(
    specs: Sequence[TensorSpec], buffers: Sequence[bytes | memoryview], *, zstd_level: int = 0
) -> bytes:
    """Encode tensors (one C-contiguous buffer each) into one entry.

    ``zstd_level`` 0 stores raw bytes; otherwise zstd at that level, falling
    back to raw when compression saves less than 5%.
    """
    _check_specs(specs)
    if len(buffers) != len(specs):
        raise InvalidRequest(f"{len(specs)} tensor specs but {len(buffers)} buffers")
    offsets, raw_len = _offsets(specs)
    raw = bytearray(raw_len)
    for i, (spec, buf, start) in enumerate(zip(specs, buffers, offsets)):
        view = memoryview(buf).cast("B")
        if view.nbytes != spec.nbytes:
            raise InvalidRequest(
                f"tensor {i}: {spec.dtype.name}{list(spec.shape)} needs {spec.nbytes} bytes, got {view.nbytes}"
            )
        raw[start : start + spec.nbytes] = view
    return _finish(specs, raw, zstd_level)


def _finish(specs: Sequence[TensorSpec], raw: bytes | bytearray | memoryview, zstd_level: int) -> bytes:
    codec, payload = Codec.raw, raw
    if zstd_level and len(raw):
        packed = _compressor(zstd_level).compress(raw)
        if len(packed) <= len(raw) * (1 - MIN_SAVING):
            codec, payload = Codec.zstd, packed
    return _pack_header(codec, specs, len(raw), payload) + payload


def parse_header(buf: bytes | memoryview) -> EntryHeader:
    """Parse and sanity-check the header of ``buf``; raises InvalidRequest if malformed."""
    return _known_header(memoryview(buf))


def _parse_header(view: memoryview) -> EntryHeader:
    if view.nbytes < _FIXED.size:
        raise InvalidRequest(f"entry of {view.nbytes} bytes is shorter than the {_FIXED.size}-byte header")
    magic, version, codec, n, raw_len, stored_len, crc = _FIXED.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise InvalidRequest(f"entry has magic {bytes(magic)!r} version {version}; expected {MAGIC!r} version {VERSION}")
    if codec not in Codec._value2member_map_:
        raise InvalidRequest(f"entry has unknown codec {codec}")
    if not 1 <= n <= MAX_TENSORS:
        raise InvalidRequest(f"an entry holds 1..{MAX_TENSORS} tensors, got {n}")
    specs, pos = [], _FIXED.size
    for i in range(n):
        if pos + _DIMS_HEAD.size > view.nbytes:
            raise InvalidRequest("entry header is truncated")
        code, ndim = _DIMS_HEAD.unpack_from(view, pos)
        pos += _DIMS_HEAD.size
        if code not in DType._value2member_map_:
            raise InvalidRequest(f"tensor {i}: unknown dtype code {code}; known: {[d.name for d in DType]}")
        if ndim > MAX_NDIM or pos + 8 * ndim > view.nbytes:
            raise InvalidRequest(f"tensor {i}: ndim {ndim} is invalid or the header is truncated")
        shape = struct.unpack_from(f"<{ndim}Q", view, pos)
        pos += 8 * ndim
        specs.append(TensorSpec(DType(code), tuple(shape)))
    header_len = _align(pos)
    _, expected_raw = _offsets(specs)
    if raw_len != expected_raw:
        raise InvalidRequest(
            f"entry declares {raw_len} payload bytes but its tensors "
            f"{[(s.dtype.name, list(s.shape)) for s in specs]} need {expected_raw}"
        )
    if codec != Codec.zstd and stored_len != raw_len:
        raise InvalidRequest(f"raw entry stores {stored_len} bytes but declares {raw_len}")
    if header_len + stored_len != view.nbytes:
        raise InvalidRequest(
            f"entry is {view.nbytes} bytes but its header says {header_len} + {stored_len} payload bytes"
        )
    return EntryHeader(Codec(codec), tuple(specs), raw_len, stored_len, crc, header_len)


# Headers seen lately, to parse entries of a known layout with a dict lookup: (magic, version, codec,
# n, raw_len) -> (header_len, the header's tensor part, specs). The entries of one cache group share
# their layout; one not in here (or not matching) is parsed in full.
_KNOWN_HEADERS: dict[bytes, tuple[int, bytes, tuple[TensorSpec, ...]]] = {}
_MAX_KNOWN_HEADERS = 256


def _known_header(view: memoryview) -> EntryHeader:
    """``_parse_header`` of ``view``, with the same result and errors, mostly from ``_KNOWN_HEADERS``."""
    layout = bytes(view[:16]) if view.nbytes >= _FIXED.size else b""
    known = _KNOWN_HEADERS.get(layout)
    if known is not None and view[_FIXED.size : known[0]] == known[1]:
        _, _, codec, _, raw_len, stored_len, crc = _FIXED.unpack_from(view)
        if known[0] + stored_len == view.nbytes and (codec == Codec.zstd or stored_len == raw_len):
            return EntryHeader(Codec(codec), known[2], raw_len, stored_len, crc, known[0])
    header = _parse_header(view)
    if len(_KNOWN_HEADERS) >= _MAX_KNOWN_HEADERS:
        _KNOWN_HEADERS.clear()
    _KNOWN_HEADERS[layout] = (header.header_len, bytes(view[_FIXED.size : header.header_len]), header.specs)
    return header


def verify_entry(buf: bytes | memoryview) -> EntryHeader:
    """Parse the header and check the checksum; raises InvalidRequest on any mismatch."""
    view = memoryview(buf)
    header = parse_header(view)
    crc = zlib.crc32(view[_CRC_OFFSET + 4 : header.header_len], zlib.crc32(view[:_CRC_OFFSET]))
    if header.codec != Codec.raw_verified:
        crc = zlib.crc32(view[header.header_len :], crc)
    if crc != header.crc:
        raise InvalidRequest(f"entry checksum mismatch: stored {header.crc:#010x}, computed {crc:#010x}")
    return header


def decode_entry(buf: bytes | memoryview, *, verify: bool = True) -> tuple[EntryHeader, memoryview]:
    """Return the header and the raw (uncompressed) payload of an encoded entry."""
    header = verify_entry(buf) if verify else parse_header(buf)
    payload = memoryview(buf)[header.header_len :]
    if header.codec == Codec.zstd:
        return header, memoryview(_decompress(payload, header.raw_len))
    return header, payload


def uniform_layout(bufs: Sequence[bytes | memoryview]) -> EntryHeader | None:
    """The header of ``bufs[0]`` when every entry has its layout and an uncompressed payload (they
    differ at most in the checksum), else None. Such entries' payloads sit at the same offsets, so a
    batch of them is copied without parsing each header; their checksums are not checked.
    """
    if not bufs:
        return None
    first = memoryview(bufs[0])
    header = parse_header(first)
    if header.codec == Codec.zstd:
        return None
    size, head, tail = first.nbytes, first[:_CRC_OFFSET], first[_CRC_OFFSET + 4 : header.header_len]
    for buf in bufs:
        view = memoryview(buf)
        if view.nbytes != size or view[:_CRC_OFFSET] != head or view[_CRC_OFFSET + 4 : header.header_len] != tail:
            return None
    return header


def _decompress(payload: memoryview, raw_len: int) -> bytes:
    try:
        raw = _decompressor().decompress(payload, max_output_size=raw_len)
    except Exception as exc:  # zstandard.ZstdError
        raise InvalidRequest(f"zstd payload does not decompress: {exc}") from exc
    if len(raw) != raw_len:
        raise InvalidRequest(f"zstd payload decompressed to {len(raw)} bytes, header says {raw_len}")
    return raw


def compress_entry(buf: bytes | memoryview, zstd_level: int) -> bytes | memoryview:
    """Re-encode a raw entry with zstd when that pays; other entries are returned as they are."""
    header = parse_header(buf)
    if header.codec != Codec.raw or not zstd_level:
        return buf
    return _finish(header.specs, memoryview(buf)[header.header_len :], zstd_level)


def to_raw_entry(buf: bytes | memoryview, *, verify: bool = True) -> tuple[bytes | memoryview, ...]:
    """The entry with an uncompressed payload, as parts to concatenate (what Fetch serves).

    A raw entry comes back as itself (one part, no copy); a zstd entry is
    verified, decompressed and gets a ``raw_verified`` header (two parts:
    header, payload). Decoding the result is a zero-copy view of its payload.
    Raises InvalidRequest when ``buf`` is malformed or fails its checksum.
    """
    return _served_parts(buf, *decode_entry(buf, verify=verify))


def _served_parts(buf: bytes | memoryview, header: EntryHeader, raw: bytes | memoryview) -> tuple:
    """The parts of ``buf`` as served, given its header and raw payload."""
    if header.codec != Codec.zstd:
        return (buf,)
    return _pack_header(Codec.raw_verified, header.specs, header.raw_len, raw), raw


def decoded_size(buf: bytes | memoryview) -> int:
    """Bytes of ``buf`` with its payload uncompressed (header + raw payload), from the fixed header alone.

    Cheap (no checksum, no per-tensor parsing): for sizing buffers before decoding.
    """
    view = memoryview(buf)
    if view.nbytes < _FIXED.size:
        raise InvalidRequest(f"entry of {view.nbytes} bytes is shorter than the {_FIXED.size}-byte header")
    magic, version, _, _, raw_len, stored_len, _ = _FIXED.unpack_from(view)
    if magic != MAGIC or version != VERSION or stored_len > view.nbytes - _FIXED.size:
        raise InvalidRequest(f"entry has magic {bytes(magic)!r} version {version} and {stored_len} payload bytes "
                             f"in {view.nbytes}; it is not a valid entry")
    return view.nbytes - stored_len + raw_len


def _decode_many(bufs: Sequence[bytes | memoryview]) -> list[tuple[EntryHeader, bytes | memoryview] | InvalidRequest]:
    """Per entry, verified: (header, raw payload) or the InvalidRequest it raised.

    The zstd payloads are decompressed in one call that holds no lock: a
    batch of small entries gives up and takes back the interpreter lock once
    instead of once per entry, which is what bounds a multi-threaded server
    on small entries.
    """
    out: list = [None] * len(bufs)
    frames, sizes, pending = [], [], []
    for i, buf in enumerate(bufs):
        try:
            header = verify_entry(buf)
        except InvalidRequest as exc:
            out[i] = exc
            continue
        payload = memoryview(buf)[header.header_len :]
        if header.codec != Codec.zstd:
            out[i] = header, payload
            continue
        frames.append(payload)
        sizes.append(header.raw_len)
        pending.append((i, header))
    if frames:
        try:
            raws = _decompressor().multi_decompress_to_buffer(
                frames, decompressed_sizes=struct.pack(f"={len(sizes)}Q", *sizes), threads=1
            )
        except Exception:  # zstandard.ZstdError: a bad frame; decompressed one by one below, to find it
            raws = None
        for n, (i, header) in enumerate(pending):
            raw = raws[n] if raws is not None else None
            if raw is None or len(raw) != header.raw_len:
                try:
                    raw = _decompress(frames[n], header.raw_len)
                except InvalidRequest as exc:
                    out[i] = exc
                    continue
            out[i] = header, raw
    return out


def to_raw_entries(bufs: Sequence[bytes | memoryview]) -> list[tuple[bytes | memoryview, ...] | InvalidRequest]:
    """``to_raw_entry`` of many entries at once: per entry its parts, or the InvalidRequest it raised."""
    return [decoded if isinstance(decoded, InvalidRequest) else _served_parts(buf, *decoded)
            for buf, decoded in zip(bufs, _decode_many(bufs))]


def to_raw_entries_into(bufs: Sequence[bytes | memoryview], outs: Sequence[memoryview]) -> list[InvalidRequest | None]:
    """Write ``to_raw_entries(bufs)`` into ``outs`` (``decoded_size`` bytes each): per entry None or the
    InvalidRequest it raised (that entry's buffer then holds garbage)."""
    errors: list[InvalidRequest | None] = []
    for out, parts in zip(outs, to_raw_entries(bufs)):
        if isinstance(parts, InvalidRequest):
            errors.append(parts)
            continue
        sizes = [memoryview(p).nbytes for p in parts]
        if out.nbytes != sum(sizes):
            errors.append(InvalidRequest(f"{out.nbytes}-byte buffer for an entry of {sum(sizes)} bytes"))
            continue
        at = 0
        for part, size in zip(parts, sizes):
            out[at : at + size] = part
            at += size
        errors.append(None)
    return errors
