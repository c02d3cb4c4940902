"""Entry encoding: a versioned header plus the (optionally compressed) tensor bytes.

Layout of one encoded entry, format version 2 (all header integers little-endian)::

    offset  size  field
    0       4     magic b"ACE1"
    4       1     format version (2)
    5       1     codec: 0 raw, 1 zstd, 2 raw_verified (served only, see Codec), 3 lz4
    6       1     checksum: 0 crc32 (zlib), 1 crc32c, 2 xxh3 (its low 32 bits)
    7       1     number of tensors n
    8       8     raw_len: bytes of the uncompressed payload
    16      8     stored_len: bytes of the payload as stored (after the codec)
    24      4     checksum of the header (this field excluded) and the stored payload
                  (of the header alone for raw_verified)
    28      ...   per tensor: dtype code (1 B), ndim (1 B), ndim x dim (8 B each)
    ...           zero padding to a multiple of 16 bytes (header_len)
    header_len    stored payload

Version 1 entries (bytes 6-7: n as uint16, checksum always crc32) are still
read. The raw payload holds the tensors in order, each C-contiguous and
starting at a multiple of 16 bytes, so decoded tensors can be viewed
without copies. The daemon checks the header and checksum of every entry it
accepts or serves. ``bench/bench_codec.py`` measured the choices on the
benchmarks' activations: xxh3 checksums 3.5x faster than zlib's CRC32, lz4
decodes 2.8x faster than zstd-1 at a lower ratio (bench/README.md).

One module of about 620 lines, one job: the entry's byte layout. Encoding, parsing and verifying it,
its codecs and checksums, and the served form Fetch builds from it change together (the format
version covers them all).
"""

from __future__ import annotations

import enum
import math
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Sequence

import crc32c
import lz4.block
import numpy as np
import xxhash

from actcache.errors import InvalidRequest

__all__ = [
    "ALIGN",
    "AUTO_MIN_SAVING",
    "CHECKSUMS",
    "Checksum",
    "Codec",
    "DEFAULT_CHECKSUM",
    "DType",
    "Encoding",
    "EntryHeader",
    "TensorSpec",
    "compress_entry",
    "compress_payload",
    "copy_raw_run",
    "decode_entry",
    "decoded_size",
    "decompress_payload",
    "encode_entry",
    "parse_header",
    "served_size",
    "stored_raw",
    "to_raw_entries",
    "to_raw_entries_into",
    "to_raw_entry",
    "uniform_layout",
    "uniform_rows",
    "verify_entry",
]

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
    """How the payload is stored. ``raw_verified`` exists only on the serving path: a compressed entry
    the daemon verified and decompressed, whose checksum covers the header alone (a fresh checksum of
    the decompressed bytes would cost a fifth of the serving CPU). Put refuses it."""

    raw = 0
    zstd = 1
    raw_verified = 2
    lz4 = 3


class Checksum(enum.IntEnum):
    """What checks an entry: zlib's CRC32 (version 1 entries), CRC32C (hardware), or xxh3's low 32 bits."""

    crc32 = 0
    crc32c = 1
    xxh3 = 2


#: The checksum new entries get: the fastest measured (bench/bench_codec.py).
DEFAULT_CHECKSUM = Checksum.xxh3
_COMPRESSED = (Codec.zstd, Codec.lz4)


def _crc32c(data, value: int) -> int:
    return crc32c.crc32c(data, value)


def _xxh3(data, value: int) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=value) & 0xFFFFFFFF


# Chained over the parts of an entry: value = f(part, value), starting at 0.
_CHECKSUM_FNS = {Checksum.crc32: zlib.crc32, Checksum.crc32c: _crc32c, Checksum.xxh3: _xxh3}
# The last link of that chain without the 32-bit mask (copy_raw_run masks a batch of them at once).
_LAST_LINK_FNS = {Checksum.crc32: zlib.crc32, Checksum.crc32c: crc32c.crc32c, Checksum.xxh3: xxhash.xxh3_64_intdigest}
#: Each checksum of one buffer, by name (bench/bench_codec.py measures them).
CHECKSUMS = {c.name: (lambda data, f=f: f(data, 0)) for c, f in _CHECKSUM_FNS.items()}


def _checksum(kind: Checksum, *parts) -> int:
    value, fn = 0, _CHECKSUM_FNS[kind]
    for part in parts:
        value = fn(part, value)
    return value


@dataclass(frozen=True)
class Encoding:
    """How entries are written: a codec (``raw``, ``zstd`` at ``level``, ``lz4``) and a checksum.

    ``auto`` (``parse("auto")``) is lz4, kept per entry only when it makes the entry faster to
    serve cold: with lz4 decoding at ~0.3 CPU-s/GB and a disk reading ~1 GB/s (measured here,
    bench/README.md), ``stored/disk + raw x 0.3 s/GB < raw/disk`` needs a saving of 30%. Sparse
    ReLU maps get it, transformer states (ratio ~1.0) stay raw.
    """

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


def _pack_header(codec: Codec, specs: Sequence[TensorSpec], raw_len: int, payload: bytes | memoryview,
                 checksum: Checksum = DEFAULT_CHECKSUM) -> bytes:
    """The header of an entry; its checksum covers ``payload`` too unless ``codec`` is raw_verified."""
    parts = [b""]
    for spec in specs:
        parts.append(_DIMS_HEAD.pack(int(spec.dtype), len(spec.shape)))
        parts.append(struct.pack(f"<{len(spec.shape)}Q", *spec.shape))
    dims = b"".join(parts)
    header_len = _align(_FIXED.size + len(dims))
    tail = dims + bytes(header_len - _FIXED.size - len(dims))
    head = _FIXED.pack(MAGIC, VERSION, int(codec), int(checksum), len(specs), raw_len, len(payload), 0)
    covered = (head[:_CRC_OFFSET], tail) if codec == Codec.raw_verified else (head[:_CRC_OFFSET], tail, payload)
    return head[:_CRC_OFFSET] + struct.pack("<I", _checksum(checksum, *covered)) + tail


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
    specs: Sequence[TensorSpec], buffers: Sequence[bytes | memoryview], *, zstd_level: int = 0,
    encoding: Encoding | None = None,
) -> bytes:
    """Encode tensors (one C-contiguous buffer each) into one entry.

    ``encoding`` says the codec and checksum; without it, ``zstd_level`` 0
    stores raw bytes and any other level zstd. A compressed payload falls
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
    if encoding is None:
        encoding = Encoding(Codec.zstd, zstd_level) if zstd_level else Encoding()
    return _finish(specs, raw, encoding)


def _finish(specs: Sequence[TensorSpec], raw: bytes | bytearray | memoryview, encoding: Encoding) -> bytes:
    codec, payload = Codec.raw, raw
    if encoding.codec in _COMPRESSED and len(raw):
        packed = compress_payload(encoding, raw)
        if len(packed) <= len(raw) * (1 - encoding.min_saving):
            codec, payload = encoding.codec, packed
    return _pack_header(codec, specs, len(raw), payload, encoding.checksum) + payload


def parse_header(buf: bytes | memoryview) -> EntryHeader:
    """Parse and sanity-check the header of ``buf``; raises InvalidRequest if malformed."""
    return _known_header(memoryview(buf))


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


def _parse_header(view: memoryview) -> EntryHeader:
    codec, checksum, n, raw_len, stored_len, crc = _fixed_fields(view)
    if codec not in Codec._value2member_map_:
        raise InvalidRequest(f"entry has unknown codec {codec}; known: {[c.name for c in Codec]}")
    if checksum not in Checksum._value2member_map_:
        raise InvalidRequest(f"entry has unknown checksum {checksum}; known: {[c.name for c in Checksum]}")
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
    if codec not in _COMPRESSED and stored_len != raw_len:
        raise InvalidRequest(f"raw entry stores {stored_len} bytes but declares {raw_len}")
    if header_len + stored_len != view.nbytes:
        raise InvalidRequest(
            f"entry is {view.nbytes} bytes but its header says {header_len} + {stored_len} payload bytes"
        )
    return EntryHeader(Codec(codec), tuple(specs), raw_len, stored_len, crc, header_len, Checksum(checksum))


# Headers seen lately, to parse entries of a known layout with a dict lookup: (magic, version, codec,
# checksum, n, raw_len) -> (header_len, the header's tensor part, a header of that layout). The entries
# of one cache group share their layout; one not in here (or not matching) is parsed in full.
_KNOWN_HEADERS: dict[bytes, tuple[int, bytes, EntryHeader]] = {}
_STORED_AND_CRC = struct.Struct("<QI")
_MAX_KNOWN_HEADERS = 256


def _known_header(view: memoryview) -> EntryHeader:
    """``_parse_header`` of ``view``, with the same result and errors, mostly from ``_KNOWN_HEADERS``."""
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


def verify_entry(buf: bytes | memoryview) -> EntryHeader:
    """Parse the header and check the checksum; raises InvalidRequest on any mismatch."""
    view = memoryview(buf)
    header = parse_header(view)
    covered = [view[:_CRC_OFFSET], view[_CRC_OFFSET + 4 : header.header_len]]
    if header.codec != Codec.raw_verified:
        covered.append(view[header.header_len :])
    crc = _checksum(header.checksum, *covered)
    if crc != header.crc:
        raise InvalidRequest(f"entry checksum ({header.checksum.name}) mismatch: stored {header.crc:#010x}, computed {crc:#010x}")
    return header


def decode_entry(buf: bytes | memoryview, *, verify: bool = True) -> tuple[EntryHeader, memoryview]:
    """Return the header and the raw (uncompressed) payload of an encoded entry."""
    header = verify_entry(buf) if verify else parse_header(buf)
    payload = memoryview(buf)[header.header_len :]
    return header, memoryview(decompress_payload(header.codec, payload, header.raw_len))


def uniform_layout(bufs: Sequence[bytes | memoryview]) -> EntryHeader | None:
    """The header of ``bufs[0]`` when every entry has its layout and an uncompressed payload (they
    differ at most in the checksum), else None. Such entries' payloads sit at the same offsets, so a
    batch of them is copied without parsing each header; their checksums are not checked.
    """
    if not bufs:
        return None
    first = memoryview(bufs[0])
    header = parse_header(first)
    if header.codec in _COMPRESSED:
        return None
    head, tail = _unchecked_header(header)
    size, first_head, first_tail = first.nbytes, first[head], first[tail]
    for buf in bufs:
        view = memoryview(buf)
        if view.nbytes != size or view[head] != first_head or view[tail] != first_tail:
            return None
    return header


def uniform_rows(rows: np.ndarray) -> EntryHeader | None:
    """``uniform_layout`` for entries laid out as the rows of a 2-D uint8 array (one entry per row,
    as consecutive ring slots are): the first row's header when every row has its layout and an
    uncompressed payload, else None. One vectorised comparison instead of one per entry."""
    if not len(rows):
        return None
    header = parse_header(rows[0])
    if header.codec in _COMPRESSED:
        return None
    head, tail = _unchecked_header(header)
    if not ((rows[1:, head] == rows[0, head]).all() and (rows[1:, tail] == rows[0, tail]).all()):
        return None
    return header


def _unchecked_header(header: EntryHeader) -> tuple[slice, slice]:
    """The header bytes around the checksum field: entries of one layout have them equal."""
    return slice(0, _CRC_OFFSET), slice(_CRC_OFFSET + 4, header.header_len)


def compress_entry(buf: bytes | memoryview, encoding: Encoding) -> bytes | memoryview:
    """Re-encode a raw entry with ``encoding``'s codec and checksum when compression pays; other
    entries (and raw ones, for a raw encoding) are returned as they are."""
    header = parse_header(buf)
    if header.codec != Codec.raw or encoding.codec not in _COMPRESSED:
        return buf
    return _finish(header.specs, memoryview(buf)[header.header_len :], encoding)


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
    if header.codec not in _COMPRESSED:
        return (buf,)
    return _pack_header(Codec.raw_verified, header.specs, header.raw_len, raw), raw


def decoded_size(buf: bytes | memoryview) -> int:
    """Bytes of ``buf`` with its payload uncompressed (header + raw payload), from the fixed header alone.

    Cheap (no checksum, no per-tensor parsing): for sizing buffers before decoding.
    """
    view = memoryview(buf)
    _, _, _, raw_len, stored_len, _ = _fixed_fields(view)
    if stored_len > view.nbytes - _FIXED.size:
        raise InvalidRequest(f"entry declares {stored_len} payload bytes in {view.nbytes}; it is not a valid entry")
    return view.nbytes - stored_len + raw_len


_CODEC_OFFSET = 5  # the codec byte (layout above), in versions 1 and 2


def stored_raw(buf: bytes | memoryview) -> bool:
    """Whether ``buf``'s header says its payload is stored uncompressed (Codec.raw), from its codec
    byte alone: cheap, and not a check that ``buf`` is a valid entry."""
    return len(buf) > _CODEC_OFFSET and buf[_CODEC_OFFSET] == Codec.raw


def served_size(buf: bytes | memoryview) -> int:
    """Bytes of ``buf`` as Fetch serves it: a raw entry as stored, a compressed one decompressed
    (``decoded_size``). A malformed entry keeps its size; it becomes a miss when it is verified."""
    if stored_raw(buf):
        return len(buf)
    try:
        return decoded_size(buf)
    except InvalidRequest:
        return len(buf)


def _decode_many(bufs: Sequence[bytes | memoryview]) -> list[tuple[EntryHeader, bytes | memoryview] | InvalidRequest]:
    """Per entry, verified: (header, raw payload) or the InvalidRequest it raised.

    The zstd payloads are decompressed in one call that holds no lock: a
    batch of small entries gives up and takes back the interpreter lock once
    instead of once per entry, which is what bounds a multi-threaded server
    on small entries. lz4 payloads are decompressed one by one.
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
            try:
                out[i] = header, decompress_payload(header.codec, payload, header.raw_len)
            except InvalidRequest as exc:
                out[i] = exc
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
                    raw = decompress_payload(Codec.zstd, frames[n], header.raw_len)
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
    InvalidRequest it raised (that entry's buffer then holds garbage).

    Raw entries of one layout (a frame of one cache group, mostly) are verified against the first
    one's parsed header: one checksum call per entry part and one copy, no header parsing each.
    """
    fast = _raw_run_into(bufs, outs)
    if fast is not None:
        return fast
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


def copy_raw_run(bufs: Sequence[bytes | memoryview], dest: memoryview) -> list[InvalidRequest | None]:
    """Copy raw entries of one size into consecutive rows of ``dest`` (``len(bufs)`` times their size)
    and verify each copy: per entry None, or the InvalidRequest its row failed with (garbage then).

    The batch form of ``to_raw_entries_into`` for the usual frame (stored raw entries of one layout):
    one copy and one checksum call per entry, the copy hashed while it is in the CPU cache, and the
    header checks and checksum comparisons one vectorised operation each. Rows of mixed layouts
    are verified one by one. The caller checks that every entry is raw and of one size.
    """
    count = len(bufs)
    size = dest.nbytes // count if count else 0
    try:
        header = parse_header(bufs[0])
    except InvalidRequest:
        header = None
    if header is None or header.codec != Codec.raw or header.total_len != size:
        return _verify_rows(bufs, dest, size)
    chain, last, hlen = _CHECKSUM_FNS[header.checksum], _LAST_LINK_FNS[header.checksum], header.header_len
    first = memoryview(bufs[0])
    seed = chain(first[_CRC_OFFSET + 4 : hlen], chain(first[:_CRC_OFFSET], 0))  # the header's part, the same for all
    hashes = []
    for lo, buf in zip(range(0, count * size, size), bufs):
        dest[lo : lo + size] = buf
        hashes.append(last(dest[lo + hlen : lo + size], seed))
    rows = np.frombuffer(dest, np.uint8).reshape(count, size)
    if uniform_rows(rows) is None:
        return _verify_rows(bufs, dest, size)
    stored = rows[:, _CRC_OFFSET : _CRC_OFFSET + 4].copy().view("<u4").ravel()
    computed = np.array(hashes, dtype=np.uint64) & 0xFFFFFFFF
    errors: list[InvalidRequest | None] = [None] * count
    for i in np.flatnonzero(computed != stored).tolist():
        errors[i] = InvalidRequest(f"entry checksum ({header.checksum.name}) mismatch: stored {int(stored[i]):#010x}, "
                                   f"computed {int(computed[i]):#010x}")
    return errors


def _verify_rows(bufs: Sequence[bytes | memoryview], dest: memoryview, size: int) -> list[InvalidRequest | None]:
    """``copy_raw_run`` one entry at a time."""
    errors: list[InvalidRequest | None] = []
    for lo, buf in zip(range(0, len(bufs) * size, size), bufs):
        row = dest[lo : lo + size]
        row[:] = buf
        try:
            header = verify_entry(row)
            errors.append(None if header.codec == Codec.raw else
                          InvalidRequest(f"entry has codec {header.codec.name} where a raw entry was expected"))
        except InvalidRequest as exc:
            errors.append(exc)
    return errors


def _raw_run_into(bufs: Sequence[bytes | memoryview], outs: Sequence[memoryview]) -> list[InvalidRequest | None] | None:
    """``to_raw_entries_into`` for raw entries sharing one layout; None (nothing written) for any other batch."""
    header = uniform_layout(bufs) if len(bufs) > 1 else None
    if header is None or header.codec != Codec.raw or any(o.nbytes != header.total_len for o in outs):
        return None
    fn, hlen = _CHECKSUM_FNS[header.checksum], header.header_len
    first = memoryview(bufs[0])
    seed = fn(first[_CRC_OFFSET + 4 : hlen], fn(first[:_CRC_OFFSET], 0))  # the header's part, the same for all
    errors: list[InvalidRequest | None] = []
    for buf, out in zip(bufs, outs):
        view = memoryview(buf)
        crc = fn(view[hlen:], seed)
        stored = int.from_bytes(view[_CRC_OFFSET : _CRC_OFFSET + 4], "little")
        if crc != stored:
            errors.append(InvalidRequest(f"entry checksum ({header.checksum.name}) mismatch: stored {stored:#010x}, "
                                         f"computed {crc:#010x}"))
            continue
        out[:] = view
        errors.append(None)
    return errors
