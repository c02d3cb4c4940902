"""Entries as Fetch serves them: raw ones as stored, compressed ones verified, decompressed and given a
``raw_verified`` header. Most functions work a batch at a time: per entry, the Python around one
checksum call and one copy costs more than both.
"""

from __future__ import annotations

import struct
import zlib
from typing import Callable, Sequence

import numpy as np
import xxhash

from actcache.codec import (
    _CHECKSUM_FNS,
    _COMPRESSED,
    _CRC_OFFSET,
    _FIXED,
    Checksum,
    Codec,
    EntryHeader,
    _checksum_mismatch,
    _decompressor,
    _fixed_fields,
    _pack_header,
    decode_entry,
    decompress_payload,
    parse_header,
    verify_entry,
)
from actcache.errors import InvalidRequest

__all__ = ["copy_raw_columns", "copy_raw_run", "decoded_size", "served_size", "stored_raw", "to_raw_entries",
           "to_raw_entries_into", "to_raw_entry", "uniform_layout", "uniform_rows"]


def uniform_layout(bufs: Sequence[bytes | memoryview]) -> EntryHeader | None:
    """The header of ``bufs[0]`` when every entry has its layout and an uncompressed payload (they differ
    at most in the checksum, which is not checked), else None."""
    header = _uncompressed_header(bufs[0]) if len(bufs) else None
    if header is None:
        return None
    first = memoryview(bufs[0])
    head, tail = _unchecked_header(header)
    size, first_head, first_tail = first.nbytes, first[head], first[tail]
    for buf in bufs:
        view = memoryview(buf)
        if view.nbytes != size or view[head] != first_head or view[tail] != first_tail:
            return None
    return header


def uniform_rows(rows: np.ndarray) -> EntryHeader | None:
    """``uniform_layout`` for entries that are the rows of a 2-D uint8 array, in one vectorised comparison."""
    header = _uncompressed_header(rows[0].data) if len(rows) else None
    if header is None:
        return None
    head, tail = _unchecked_header(header)
    same = (rows[1:, head] == rows[0, head]).all() and (rows[1:, tail] == rows[0, tail]).all()
    return header if same else None


def _uncompressed_header(buf: bytes | memoryview) -> EntryHeader | None:
    header = parse_header(buf)
    return None if header.codec in _COMPRESSED else header


def _unchecked_header(header: EntryHeader) -> tuple[slice, slice]:
    """The header bytes around the checksum field: entries of one layout have them equal."""
    return slice(0, _CRC_OFFSET), slice(_CRC_OFFSET + 4, header.header_len)


def to_raw_entry(buf: bytes | memoryview) -> tuple[bytes | memoryview, ...]:
    """The entry as Fetch serves it, as parts to concatenate: a raw one itself, a compressed one its
    ``raw_verified`` header and raw payload. Raises InvalidRequest if malformed or failing its checksum."""
    return _served_parts(buf, *decode_entry(buf))


def _served_parts(buf: bytes | memoryview, header: EntryHeader, raw: bytes | memoryview) -> tuple:
    if header.codec not in _COMPRESSED:
        return (buf,)
    return _pack_header(Codec.raw_verified, header.specs, header.raw_len, raw), raw


def decoded_size(buf: bytes | memoryview) -> int:
    """Bytes of ``buf`` with its payload uncompressed, from the fixed header alone (cheap)."""
    view = memoryview(buf)
    _, _, _, raw_len, stored_len, _ = _fixed_fields(view)
    if stored_len > view.nbytes - _FIXED.size:
        raise InvalidRequest(f"entry declares {stored_len} payload bytes in {view.nbytes}; it is not a valid entry")
    return view.nbytes - stored_len + raw_len


_CODEC_OFFSET = 5  # the codec byte (actcache.codec's layout), in versions 1 and 2


def stored_raw(buf: bytes | memoryview) -> bool:
    """Whether ``buf``'s codec byte says raw (cheap; not a check that ``buf`` is a valid entry)."""
    return len(buf) > _CODEC_OFFSET and buf[_CODEC_OFFSET] == Codec.raw


def served_size(buf: bytes | memoryview) -> int:
    """Bytes of ``buf`` as Fetch serves it; a malformed entry keeps its size (it is a miss once verified)."""
    if stored_raw(buf):
        return len(buf)
    try:
        return decoded_size(buf)
    except InvalidRequest:
        return len(buf)


def _decompress_together(bufs: Sequence[bytes | memoryview], headers: list, zstd: list[int]) -> dict:
    """The zstd payloads at positions ``zstd``, decompressed in one call; {} if one frame is bad (each is then
    decompressed on its own, to find it)."""
    sizes = struct.pack(f"={len(zstd)}Q", *(headers[i].raw_len for i in zstd))
    try:
        many = _decompressor().multi_decompress_to_buffer(
            [memoryview(bufs[i])[headers[i].header_len :] for i in zstd], decompressed_sizes=sizes, threads=1)
    except Exception:  # zstandard.ZstdError
        return {}
    return {i: many[n] for n, i in enumerate(zstd)}


def to_raw_entries(bufs: Sequence[bytes | memoryview]) -> list[tuple[bytes | memoryview, ...] | InvalidRequest]:
    """``to_raw_entry`` of many entries at once: per entry its parts, or the InvalidRequest it raised. The zstd
    payloads are decompressed in one call, releasing the interpreter lock once, not per entry."""
    headers = [_or_error(verify_entry, buf) for buf in bufs]
    zstd = [i for i, h in enumerate(headers) if isinstance(h, EntryHeader) and h.codec == Codec.zstd]
    raws = _decompress_together(bufs, headers, zstd) if zstd else {}
    out: list = []
    for i, (buf, header) in enumerate(zip(bufs, headers)):
        if isinstance(header, InvalidRequest):
            out.append(header)
            continue
        raw = raws.get(i)
        if raw is None or len(raw) != header.raw_len:
            raw = _or_error(decompress_payload, header.codec, memoryview(buf)[header.header_len :], header.raw_len)
        out.append(raw if isinstance(raw, InvalidRequest) else _served_parts(buf, header, raw))
    return out


def _or_error(fn: Callable, *args):
    try:
        return fn(*args)
    except InvalidRequest as exc:
        return exc


def to_raw_entries_into(bufs: Sequence[bytes | memoryview], outs: Sequence[memoryview]) -> list[InvalidRequest | None]:
    """Write ``to_raw_entries(bufs)`` into ``outs`` (``decoded_size`` bytes each): per entry None or the
    InvalidRequest it raised (that entry's buffer then holds garbage)."""
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
    """Copy raw entries of one size into consecutive rows of ``dest`` and verify each copy (hashed while
    in the CPU cache): per entry None, or the InvalidRequest its row failed with (garbage then)."""
    count = len(bufs)
    size = dest.nbytes // count if count else 0
    header = _or_error(parse_header, bufs[0])
    if isinstance(header, InvalidRequest) or header.codec != Codec.raw or header.total_len != size:
        return _verify_rows(bufs, dest, size)
    last, seed = _payload_checksum(header, bufs[0])
    hlen = header.header_len
    rows = np.frombuffer(dest, np.uint8).reshape(count, size)
    hashes = []
    for row, buf in zip(rows, bufs):
        row[:] = np.frombuffer(buf, np.uint8)  # numpy copies without the interpreter lock (a split runs in threads)
        hashes.append(last(row[hlen:], seed))
    if uniform_rows(rows) is None:
        return _verify_rows(bufs, dest, size)
    stored = rows[:, _CRC_OFFSET : _CRC_OFFSET + 4].copy().view("<u4").ravel()
    computed = np.array(hashes, dtype=np.uint64) & 0xFFFFFFFF
    errors: list[InvalidRequest | None] = [None] * count
    for i in np.flatnonzero(computed != stored).tolist():
        errors[i] = _checksum_mismatch(header.checksum, int(stored[i]), int(computed[i]))
    return errors


def copy_raw_columns(bufs: Sequence[bytes | memoryview], header: EntryHeader,
                     columns: Sequence[memoryview]) -> list[InvalidRequest | None]:
    """Copy raw entries of ``header``'s layout (``uniform_layout``, codec raw) as columns: tensor j of entry i
    to bytes ``[i * n_j, (i + 1) * n_j)`` of ``columns[j]`` (``n_j`` its size), and verify each entry (hashed
    from its source, in the CPU cache after the copy): per entry None, or the InvalidRequest it failed with
    (its columns' bytes are garbage then)."""
    last, seed = _payload_checksum(header, bufs[0])
    hlen = header.header_len
    parts = [(hlen + at, spec.nbytes) for at, spec in zip(header.offsets, header.specs)]
    targets = [np.frombuffer(column, np.uint8) for column in columns]
    errors: list[InvalidRequest | None] = []
    for i, buf in enumerate(bufs):
        view, source = memoryview(buf), np.frombuffer(buf, np.uint8)
        for (at, n), target in zip(parts, targets):  # numpy copies without the interpreter lock
            target[i * n : (i + 1) * n] = source[at : at + n]
        crc = last(source[hlen:], seed) & 0xFFFFFFFF
        stored = int.from_bytes(view[_CRC_OFFSET : _CRC_OFFSET + 4], "little")
        errors.append(None if crc == stored else _checksum_mismatch(header.checksum, stored, crc))
    return errors


def _verify_rows(bufs: Sequence[bytes | memoryview], dest: memoryview, size: int) -> list[InvalidRequest | None]:
    """``copy_raw_run`` one entry at a time."""
    errors: list[InvalidRequest | None] = []
    for lo, buf in zip(range(0, len(bufs) * size, size), bufs):
        row = dest[lo : lo + size]
        row[:] = buf
        header = _or_error(verify_entry, row)
        if isinstance(header, EntryHeader) and header.codec != Codec.raw:
            header = InvalidRequest(f"entry has codec {header.codec.name} where a raw entry was expected")
        errors.append(header if isinstance(header, InvalidRequest) else None)
    return errors


def _raw_run_into(bufs: Sequence[bytes | memoryview], outs: Sequence[memoryview]) -> list[InvalidRequest | None] | None:
    """``to_raw_entries_into`` for raw entries sharing one layout; None (nothing written) for any other batch."""
    header = uniform_layout(bufs) if len(bufs) > 1 else None
    if header is None or header.codec != Codec.raw or any(o.nbytes != header.total_len for o in outs):
        return None
    last, seed = _payload_checksum(header, bufs[0])
    hlen = header.header_len
    errors: list[InvalidRequest | None] = []
    for buf, out in zip(bufs, outs):
        view = memoryview(buf)
        crc = last(view[hlen:], seed) & 0xFFFFFFFF
        stored = int.from_bytes(view[_CRC_OFFSET : _CRC_OFFSET + 4], "little")
        if crc == stored:
            out[:] = view
        errors.append(None if crc == stored else _checksum_mismatch(header.checksum, stored, crc))
    return errors


# The last link of an entry's checksum chain without the 32-bit mask (a batch of them is masked at once).
_LAST_LINK_FNS = {Checksum.crc32: zlib.crc32, Checksum.xxh3: xxhash.xxh3_64_intdigest}


def _payload_checksum(header: EntryHeader, first: bytes | memoryview) -> tuple[Callable, int]:
    """``(last, seed)``: a raw entry of ``first``'s layout has checksum ``last(payload, seed) & 0xFFFFFFFF``."""
    chain, view = _CHECKSUM_FNS[header.checksum], memoryview(first)
    return _LAST_LINK_FNS[header.checksum], chain(view[_CRC_OFFSET + 4 : header.header_len], chain(view[:_CRC_OFFSET], 0))
