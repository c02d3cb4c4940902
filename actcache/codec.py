"""Entry encoding: a versioned header plus the (optionally compressed) tensor bytes.

Layout of one encoded entry, format version 2 (all header integers little-endian)::

    offset  size  field
    0       4     magic b"ACE1"
    4       1     format version (2)
    5       1     codec: 0 raw, 1 zstd, 2 raw_verified (served only, see Codec), 3 lz4
    6       1     checksum: 0 crc32 (zlib), 2 xxh3 (its low 32 bits); 1 is unused (an entry naming it is corrupt)
    7       1     number of tensors n
    8       8     raw_len: bytes of the uncompressed payload
    16      8     stored_len: bytes of the payload as stored (after the codec)
    24      4     checksum of the header (this field excluded) and the stored payload
                  (of the header alone for raw_verified)
    28      ...   per tensor: dtype code (1 B), ndim (1 B), ndim x dim (8 B each)
    ...           zero padding to a multiple of 16 bytes (header_len)
    header_len    stored payload

Version 1 entries (bytes 6-7: n as uint16, checksum always crc32) are still read. The raw payload holds
the tensors in order, each C-contiguous and 16-byte aligned, so they can be viewed without copies.
"""

from __future__ import annotations

import enum
import itertools
import math
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import lz4.block
import numpy as np
import xxhash

if TYPE_CHECKING:
    from typing_extensions import Buffer

from actcache.errors import InvalidRequest

__all__ = ["ALIGN", "AUTO_MIN_SAVING", "CHECKSUMS", "Checksum", "Codec", "DEFAULT_CHECKSUM", "DType", "Encoding",
           "EntryHeader", "TensorSpec", "compress_entry", "compress_payload", "decode_entry", "decompress_payload",
           "encode_batch", "encode_entry", "pack_layout", "parse_header", "parse_header_alone", "raw_entry_bytes",
           "unpack_layout",
           "verify_entry"]

MAGIC = b"ACE1"
VERSION = 2
ALIGN = 16
MAX_TENSORS = 64
MAX_NDIM = 16
_FIXED = struct.Struct("<4sBBBBQQI")  # version 2
_FIXED_V1 = struct.Struct("<4sBBHQQI")
_CRC_OFFSET = 24
_DIMS_HEAD = struct.Struct("<BB")
# Keep the raw payload when compression saves less than this share of its bytes.
MIN_SAVING = 0.05
# The saving the ``auto`` encoding asks of lz4 (see Encoding).
AUTO_MIN_SAVING = 0.30


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
        return (0, 4, 2, 2, 8, 4, 1, 1)[self]


class Codec(enum.IntEnum):
    """How the payload is stored. ``raw_verified``, only on the serving path, is a compressed entry the
    daemon verified and decompressed, its checksum covering the header alone (cheaper). Put refuses it."""

    raw = 0
    zstd = 1
    raw_verified = 2
    lz4 = 3


class Checksum(enum.IntEnum):
    """What checks an entry: zlib's CRC32 (version 1 entries) or xxh3's low 32 bits. Id 1 is not
    used: a header naming it fails to parse, like any unknown id, so the entry reads as corrupt."""

    crc32 = 0
    xxh3 = 2


#: The checksum new entries get: the fastest measured (bench/bench_codec.py).
DEFAULT_CHECKSUM = Checksum.xxh3
_COMPRESSED = (Codec.zstd, Codec.lz4)


def _xxh3(data: Any, value: int) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=value) & 0xFFFFFFFF


# Chained over the parts of an entry: value = f(part, value), starting at 0.
_CHECKSUM_FNS: dict[Checksum, Callable[[Any, int], int]] = {Checksum.crc32: zlib.crc32, Checksum.xxh3: _xxh3}
#: Each checksum of one buffer, by name (bench/bench_codec.py measures them).
CHECKSUMS = {c.name: (lambda data, f=f: f(data, 0)) for c, f in _CHECKSUM_FNS.items()}


def _checksum(kind: Checksum, *parts) -> int:
    value, fn = 0, _CHECKSUM_FNS[kind]
    for part in parts:
        value = fn(part, value)
    return value


@dataclass(frozen=True)
class Encoding:
    """How entries are written: a codec (``raw``, ``zstd`` at ``level``, ``lz4``) and a checksum. ``auto``
    is lz4 kept only when it saves 30%: only then is an entry faster to serve cold (docs/benchmarks.md)."""

    codec: Codec = Codec.raw
    level: int = 0
    checksum: Checksum = DEFAULT_CHECKSUM
    #: Keep a compressed payload only when it saves at least this share of the bytes.
    min_saving: float = MIN_SAVING

    def __post_init__(self) -> None:
        if self.codec == Codec.raw_verified:
            raise InvalidRequest("raw_verified is the serving path's codec; entries are written raw, zstd or lz4")
        if self.codec == Codec.zstd and (self.level == 0 or not -7 <= self.level <= 22):
            raise InvalidRequest(f"zstd level must be -7..22 and not 0, got {self.level}")

    @classmethod
    def parse(cls, text: str) -> "Encoding":
        """``auto``, ``raw``, ``lz4``, ``zstd`` (level 1) or ``zstd:LEVEL``; raises InvalidRequest naming the choices."""
        if text == "auto":
            return cls(Codec.lz4, min_saving=AUTO_MIN_SAVING)
        name, _, level = text.partition(":")
        try:
            codec = Codec[name]
            if codec == Codec.raw_verified or level and codec != Codec.zstd:
                raise KeyError(name)
            return cls(codec, int(level) if level else (1 if codec == Codec.zstd else 0))
        except (KeyError, ValueError):
            raise InvalidRequest(f"unknown encoding {text!r}; use auto, raw, lz4, zstd or zstd:LEVEL (-7..22)") from None


def compress_payload(encoding: Encoding, payload: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """The payload as ``encoding``'s codec stores it (``payload`` itself for raw)."""
    if encoding.codec == Codec.zstd:
        return _compressor(encoding.level).compress(payload)
    if encoding.codec == Codec.lz4:
        return lz4.block.compress(payload, store_size=False)
    return payload


def decompress_payload(codec: Codec, payload: memoryview, raw_len: int) -> bytes | memoryview:
    """The raw payload of a ``codec`` payload of ``raw_len`` bytes; raises InvalidRequest if it does not decode."""
    if codec not in _COMPRESSED:
        return payload
    try:
        if codec == Codec.zstd:
            raw = _decompressor().decompress(payload, max_output_size=raw_len)
        else:
            raw = lz4.block.decompress(payload, uncompressed_size=raw_len)
    except Exception as exc:  # zstandard.ZstdError, lz4.block.LZ4BlockError
        raise InvalidRequest(f"{codec.name} payload does not decompress: {exc}") from exc
    if len(raw) != raw_len:
        raise InvalidRequest(f"{codec.name} payload decompressed to {len(raw)} bytes, header says {raw_len}")
    return raw


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
    checksum: Checksum = Checksum.crc32

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


def _header_tail(specs: Sequence[TensorSpec]) -> bytes:
    """The header after its fixed fields: each tensor's dtype and shape, padded to ALIGN."""
    dims = b"".join(_DIMS_HEAD.pack(s.dtype, len(s.shape)) + struct.pack(f"<{len(s.shape)}Q", *s.shape) for s in specs)
    return dims + bytes(_align(_FIXED.size + len(dims)) - _FIXED.size - len(dims))


def _pack_header(codec: Codec, specs: Sequence[TensorSpec], raw_len: int, payload: bytes | bytearray | memoryview,
                 checksum: Checksum = DEFAULT_CHECKSUM) -> bytes:
    """The header of an entry; its checksum covers ``payload`` too unless ``codec`` is raw_verified."""
    tail = _header_tail(specs)
    head = _FIXED.pack(MAGIC, VERSION, int(codec), int(checksum), len(specs), raw_len, len(payload), 0)
    covered = (head[:_CRC_OFFSET], tail) if codec == Codec.raw_verified else (head[:_CRC_OFFSET], tail, payload)
    return head[:_CRC_OFFSET] + struct.pack("<I", _checksum(checksum, *covered)) + tail


_local = threading.local()


def _compressor(level: int):
    import zstandard

    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor():
    import zstandard

    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def _check_count(n: int) -> None:
    if not 1 <= n <= MAX_TENSORS:
        raise InvalidRequest(f"an entry holds 1..{MAX_TENSORS} tensors, got {n}")


def encode_entry(
    specs: Sequence[TensorSpec], buffers: Sequence[bytes | memoryview], *, zstd_level: int = 0,
    encoding: Encoding | None = None,
) -> bytes:
    """Encode tensors (one C-contiguous buffer each) into one entry, with ``encoding`` (default: raw, or
    zstd at ``zstd_level`` if not 0). A compressed payload falls back to raw when it saves less than 5%."""
    _check_count(len(specs))
    for i, spec in enumerate(specs):
        if len(spec.shape) > MAX_NDIM or any(d < 0 for d in spec.shape):
            raise InvalidRequest(f"tensor {i}: shape {spec.shape} is invalid (ndim <= {MAX_NDIM}, dims >= 0)")
    if len(buffers) != len(specs):
        raise InvalidRequest(f"{len(specs)} tensor specs but {len(buffers)} buffers")
    offsets, raw_len = _offsets(specs)
    raw = bytearray(raw_len)
    for i, (spec, buf, start) in enumerate(zip(specs, buffers, offsets)):
        view = memoryview(buf).cast("B")
        if view.nbytes != spec.nbytes:
            raise InvalidRequest(f"tensor {i}: {spec.dtype.name}{list(spec.shape)} needs {spec.nbytes} bytes, "
                                 f"got {view.nbytes}")
        raw[start : start + spec.nbytes] = view
    if encoding is None:
        encoding = Encoding(Codec.zstd, zstd_level) if zstd_level else Encoding()
    return _finish(specs, raw, encoding)


def encode_batch(specs: Sequence[TensorSpec], columns: Sequence[np.ndarray]) -> np.ndarray:
    """The raw entries of a batch whose samples share ``specs``, one per row of a ``(batch, entry bytes)`` uint8
    array; ``columns[j]`` holds tensor j of every sample, a ``(batch, nbytes)`` uint8 row each. Row i is
    ``encode_entry(specs, [c[i] for c in columns])`` byte for byte, laid out with one copy per tensor."""
    _check_count(len(specs))
    if len(columns) != len(specs):
        raise InvalidRequest(f"{len(columns)} tensor columns for {len(specs)} specs")
    for i, spec in enumerate(specs):
        if len(spec.shape) > MAX_NDIM or any(d < 0 for d in spec.shape):
            raise InvalidRequest(f"tensor {i}: shape {spec.shape} is invalid (ndim <= {MAX_NDIM}, dims >= 0)")
    batch = len(columns[0]) if columns else 0
    for i, (column, spec) in enumerate(zip(columns, specs)):
        if column.dtype != np.uint8 or column.shape != (batch, spec.nbytes):
            raise InvalidRequest(f"tensor {i}: a {column.dtype}{list(column.shape)} column for {batch} entries of "
                                 f"{spec.nbytes} bytes")
    offsets, raw_len = _offsets(specs)
    tail = _header_tail(specs)
    head = _FIXED.pack(MAGIC, VERSION, int(Codec.raw), int(DEFAULT_CHECKSUM), len(specs), raw_len, raw_len, 0)[:_CRC_OFFSET]
    start = len(head) + 4 + len(tail)  # of the payload
    out = np.empty((batch, start + raw_len), dtype=np.uint8)
    out[:, : len(head)] = np.frombuffer(head, np.uint8)
    out[:, len(head) + 4 : start] = np.frombuffer(tail, np.uint8)
    if any(at != end for at, end in zip(offsets, itertools.accumulate((s.nbytes for s in specs), initial=0))):
        out[:, start:] = 0  # alignment padding between tensors
    for column, at, spec in zip(columns, offsets, specs):
        out[:, start + at : start + at + spec.nbytes] = column
    fn = _CHECKSUM_FNS[DEFAULT_CHECKSUM]
    prefix = fn(tail, fn(head, 0))  # the checksum is chained over head, tail, payload
    crcs = np.fromiter((fn(row, prefix) for row in out[:, start:]), dtype="<u4", count=batch)
    out[:, len(head) : len(head) + 4] = crcs.view(np.uint8).reshape(batch, 4)
    return out


def _finish(specs: Sequence[TensorSpec], raw: bytes | bytearray | memoryview, encoding: Encoding) -> bytes:
    codec, payload = Codec.raw, raw
    if encoding.codec in _COMPRESSED and len(raw):
        packed = compress_payload(encoding, raw)
        if len(packed) <= len(raw) * (1 - encoding.min_saving):
            codec, payload = encoding.codec, packed
    return _pack_header(codec, specs, len(raw), payload, encoding.checksum) + payload


def _fixed_fields(view: memoryview) -> tuple[int, int, int, int, int, int]:
    """``(codec, checksum, n, raw_len, stored_len, crc)`` of a version 1 or 2 header."""
    if view.nbytes < _FIXED.size:
        raise InvalidRequest(f"entry of {view.nbytes} bytes is shorter than the {_FIXED.size}-byte header")
    magic, version = bytes(view[:4]), view[4]
    if magic != MAGIC or version not in (1, VERSION):
        raise InvalidRequest(f"entry has magic {magic!r} version {version}; expected {MAGIC!r} version 1 or {VERSION}")
    if version == 1:
        _, _, codec, n, raw_len, stored_len, crc = _FIXED_V1.unpack_from(view)
        return codec, Checksum.crc32, n, raw_len, stored_len, crc
    _, _, codec, checksum, n, raw_len, stored_len, crc = _FIXED.unpack_from(view)
    return codec, checksum, n, raw_len, stored_len, crc


def _parse_header(view: memoryview, *, with_payload: bool = True) -> EntryHeader:
    codec, checksum, n, raw_len, stored_len, crc = _fixed_fields(view)
    if codec not in Codec._value2member_map_:
        raise InvalidRequest(f"entry has unknown codec {codec}; known: {[c.name for c in Codec]}")
    if checksum not in Checksum._value2member_map_:
        raise InvalidRequest(f"entry has unknown checksum {checksum}; known: {[c.name for c in Checksum]}")
    _check_count(n)
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
    if codec not in _COMPRESSED and stored_len != raw_len:
        raise InvalidRequest(f"raw entry stores {stored_len} bytes but declares {raw_len}")
    if with_payload and header_len + stored_len != view.nbytes:
        raise InvalidRequest(f"entry is {view.nbytes} bytes but its header says {header_len} + {stored_len} payload bytes")
    return EntryHeader(Codec(codec), tuple(specs), raw_len, stored_len, crc, header_len, Checksum(checksum))


# Headers seen lately (the entries of one cache group share one): (magic, version, codec, checksum, n,
# raw_len) -> (header_len, the header's tensor part, a header of that layout); others are parsed in full.
_KNOWN_HEADERS: dict[bytes, tuple[int, bytes, EntryHeader]] = {}
_STORED_AND_CRC = struct.Struct("<QI")
_MAX_KNOWN_HEADERS = 256


def parse_header(buf: Buffer) -> EntryHeader:
    """Parse and sanity-check the header of ``buf``; raises InvalidRequest if malformed."""
    view = memoryview(buf)
    layout = bytes(view[:16]) if view.nbytes >= _FIXED.size else b""
    known = _KNOWN_HEADERS.get(layout)
    if known is not None and view[_FIXED.size : known[0]] == known[1]:
        header = known[2]
        stored_len, crc = _STORED_AND_CRC.unpack_from(view, 16)
        if header.header_len + stored_len == view.nbytes and (header.codec in _COMPRESSED or stored_len == header.raw_len):
            return EntryHeader(header.codec, header.specs, header.raw_len, stored_len, crc, header.header_len,
                               header.checksum)
    header = _parse_header(view)
    if len(_KNOWN_HEADERS) >= _MAX_KNOWN_HEADERS:
        _KNOWN_HEADERS.clear()
    _KNOWN_HEADERS[layout] = (header.header_len, bytes(view[_FIXED.size : header.header_len]), header)
    return header


def parse_header_alone(buf: Buffer) -> EntryHeader:
    """``parse_header`` of an entry's header without its payload (``header_len`` bytes or more)."""
    return _parse_header(memoryview(buf), with_payload=False)


def pack_layout(specs: Sequence[TensorSpec]) -> bytes:
    """The tensors of an entry as bytes (the header of a raw entry of ``specs``, its checksum 0)."""
    _check_count(len(specs))
    raw_len = _offsets(specs)[1]
    return _FIXED.pack(MAGIC, VERSION, int(Codec.raw), int(DEFAULT_CHECKSUM), len(specs), raw_len, raw_len, 0) + \
        _header_tail(specs)


def raw_entry_bytes(specs: Sequence[TensorSpec]) -> int:
    """The size of a raw entry of tensors of ``specs``: its header and its payload."""
    return _FIXED.size + len(_header_tail(specs)) + _offsets(specs)[1]


def unpack_layout(data: bytes) -> tuple[TensorSpec, ...]:
    """The specs ``pack_layout`` packed; raises InvalidRequest if ``data`` is not such bytes."""
    header = parse_header_alone(data)
    if header.codec != Codec.raw or header.header_len != len(data):
        raise InvalidRequest(f"a layout of {len(data)} bytes is not the header of a raw entry")
    return header.specs


def verify_entry(buf: bytes | memoryview) -> EntryHeader:
    """Parse the header and check the checksum; raises InvalidRequest on any mismatch."""
    view = memoryview(buf)
    header = parse_header(view)
    covered = [view[:_CRC_OFFSET], view[_CRC_OFFSET + 4 : header.header_len]]
    if header.codec != Codec.raw_verified:
        covered.append(view[header.header_len :])
    crc = _checksum(header.checksum, *covered)
    if crc != header.crc:
        raise _checksum_mismatch(header.checksum, header.crc, crc)
    return header


def _checksum_mismatch(kind: Checksum, stored: int, computed: int) -> InvalidRequest:
    return InvalidRequest(f"entry checksum ({kind.name}) mismatch: stored {stored:#010x}, computed {computed:#010x}")


def decode_entry(buf: bytes | memoryview, *, verify: bool = True) -> tuple[EntryHeader, memoryview]:
    """Return the header and the raw (uncompressed) payload of an encoded entry."""
    header = verify_entry(buf) if verify else parse_header(buf)
    payload = memoryview(buf)[header.header_len :]
    return header, memoryview(decompress_payload(header.codec, payload, header.raw_len))


def compress_entry(buf: bytes | memoryview, encoding: Encoding) -> bytes | memoryview:
    """Re-encode a raw entry with ``encoding`` when compression pays; others are returned as they are."""
    if encoding.codec not in _COMPRESSED:
        return buf
    header = parse_header(buf)
    if header.codec != Codec.raw:
        return buf
    return _finish(header.specs, memoryview(buf)[header.header_len :], encoding)

