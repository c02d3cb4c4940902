import dataclasses
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actcache.codec import (
    AUTO_MIN_SAVING,
    Checksum,
    Codec,
    DType,
    Encoding,
    TensorSpec,
    _pack_header,
    _parse_header,
    compress_entry,
    decode_entry,
    encode_entry,
    parse_header,
    verify_entry,
)
from actcache.errors import InvalidRequest
from actcache.served import (
    copy_raw_columns,
    copy_raw_run,
    decoded_size,
    served_size,
    to_raw_entries,
    to_raw_entries_into,
    to_raw_entry,
)

NUMPY = {DType.float32: np.float32, DType.float16: np.float16, DType.bfloat16: np.uint16,
         DType.int64: np.int64, DType.int32: np.int32, DType.uint8: np.uint8, DType.bool: np.bool_}


def tensors(draw_seed: int, specs):
    rng = np.random.default_rng(draw_seed)
    out = []
    for spec in specs:
        raw = rng.integers(0, 256, size=spec.nbytes, dtype=np.uint8)
        if spec.dtype == DType.bool:
            raw = raw % 2
        out.append(raw.view(NUMPY[spec.dtype]).reshape(spec.shape))
    return out


spec_strategy = st.builds(
    TensorSpec, st.sampled_from(list(DType)), st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)
)


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(spec_strategy, min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1), level=st.sampled_from([0, 1, 3]))
@pytest.mark.slow
def test_round_trip_is_bit_exact(specs, seed, level):
    arrays = tensors(seed, specs)
    encoded = encode_entry(specs, [a.tobytes() for a in arrays], zstd_level=level)
    header, raw = decode_entry(encoded)
    assert header.specs == tuple(specs)
    for spec, offset, array in zip(header.specs, header.offsets, arrays):
        assert offset % 16 == 0
        assert bytes(raw[offset : offset + spec.nbytes]) == array.tobytes()


def test_compression_used_only_when_it_pays():
    sparse = np.zeros((64, 32, 32), np.float32)
    sparse[::3] = 1.5
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    assert parse_header(encode_entry([TensorSpec(DType.float32, sparse.shape)], [sparse], zstd_level=1)).codec == Codec.zstd
    assert parse_header(encode_entry([TensorSpec(DType.uint8, (4096,))], [noise], zstd_level=1)).codec == Codec.raw
    raw_entry = encode_entry([TensorSpec(DType.float32, sparse.shape)], [sparse])
    packed = compress_entry(raw_entry, Encoding(Codec.zstd, 1))
    assert len(packed) < len(raw_entry) / 4
    assert bytes(decode_entry(packed)[1]) == bytes(decode_entry(raw_entry)[1])


@pytest.mark.parametrize("position", [0, 5, 10, 26, 30, 60, 200, -1])
def test_any_flipped_byte_is_detected(position):
    a = np.arange(100, dtype=np.float32)
    encoded = bytearray(encode_entry([TensorSpec(DType.float32, (100,))], [a], zstd_level=1))
    encoded[position] ^= 0x40
    with pytest.raises(InvalidRequest):
        verify_entry(encoded)


def test_length_mismatches_are_invalid():
    a = np.arange(10, dtype=np.float32)
    with pytest.raises(InvalidRequest, match="needs 40 bytes, got 36"):
        encode_entry([TensorSpec(DType.float32, (10,))], [a[:9]])
    good = encode_entry([TensorSpec(DType.float32, (10,))], [a])
    with pytest.raises(InvalidRequest, match="header says"):
        parse_header(good + b"\0")
    with pytest.raises(InvalidRequest, match="shorter than"):
        parse_header(good[:10])
    with pytest.raises(InvalidRequest, match="magic"):
        parse_header(b"XXXX" + good[4:])


@pytest.mark.parametrize("level", [0, 1])
def test_to_raw_entry_gives_an_uncompressed_entry_with_the_same_tensors(level):
    a = np.maximum(np.random.default_rng(0).standard_normal((4, 50), dtype=np.float32), 0)
    b = np.arange(7, dtype=np.int64)
    specs = [TensorSpec(DType.float32, a.shape), TensorSpec(DType.int64, b.shape)]
    stored = encode_entry(specs, [a, b], zstd_level=level)
    parts = to_raw_entry(stored)
    raw = b"".join(bytes(p) for p in parts)
    header, payload = decode_entry(raw)  # verifies the header checksum (and a raw payload's)
    assert header.codec == (Codec.raw_verified if level else Codec.raw) and header.specs == tuple(specs)
    assert bytes(payload) == bytes(decode_entry(stored)[1])
    assert len(parts) == (1 if parse_header(stored).codec == Codec.raw else 2)
    corrupt = bytearray(stored)
    corrupt[-1] ^= 1
    with pytest.raises(InvalidRequest):
        to_raw_entry(bytes(corrupt))


def test_raw_verified_checksum_covers_the_header_only():
    a = np.maximum(np.random.default_rng(1).standard_normal((8, 64), dtype=np.float32), 0)
    encoded = encode_entry([TensorSpec(DType.float32, a.shape)], [a], zstd_level=1)
    served = bytearray(b"".join(bytes(p) for p in to_raw_entry(encoded)))
    header = verify_entry(bytes(served))
    assert header.codec == Codec.raw_verified and header.stored_len == header.raw_len == a.nbytes
    served[-1] ^= 1  # the payload is not covered: the daemon verified it before decompressing
    verify_entry(bytes(served))
    served[28] ^= 4  # the dtype, float32 -> int32 (same size): covered
    with pytest.raises(InvalidRequest, match="checksum"):
        verify_entry(bytes(served))


def _outcome(parse, buf):
    try:
        return parse(memoryview(buf))
    except InvalidRequest as exc:
        return str(exc)


@pytest.mark.parametrize("level", [0, 1])
def test_a_known_layout_parses_exactly_as_a_full_parse(level):
    a = np.maximum(np.random.default_rng(2).standard_normal((6, 40), dtype=np.float32), 0)
    good = encode_entry([TensorSpec(DType.float32, a.shape)], [a], zstd_level=level)
    parse_header(good)  # the layout is now known
    stored_len = bytearray(good)
    struct.pack_into("<Q", stored_len, 16, len(good) + 8)
    other_dtype = bytearray(good)
    other_dtype[28] = DType.int32  # same size, other tensor part
    other_dims = bytearray(good)
    struct.pack_into("<Q", other_dims, 30, 3)  # 3 x 40 floats: raw_len no longer matches
    for variant in (good, good + b"\0", good[:-1], bytes(stored_len), bytes(other_dtype), bytes(other_dims)):
        assert _outcome(parse_header, variant) == _outcome(_parse_header, variant)
    assert parse_header(other_dtype).specs == (TensorSpec(DType.int32, a.shape),)


def test_batch_decoding_gives_what_to_raw_entry_gives_and_isolates_bad_entries():
    rng = np.random.default_rng(3)
    arrays = [np.maximum(rng.standard_normal((64, 300), dtype=np.float32), 0) for _ in range(4)]  # several zstd blocks
    spec = [TensorSpec(DType.float32, arrays[0].shape)]
    good = [encode_entry(spec, [a], zstd_level=level) for a, level in zip(arrays, [1, 0, 1, 1])]
    bad_crc = bytearray(good[2])
    bad_crc[-1] ^= 1
    garbage = bytes(100)  # a checksum-valid entry whose zstd payload does not decompress
    bad_zstd = _pack_header(Codec.zstd, spec, arrays[0].nbytes, garbage) + garbage
    stored = [good[0], good[1], bytes(bad_crc), bad_zstd, good[3]]
    expected = [b"".join(bytes(p) for p in to_raw_entry(e)) for e in good]

    parts = to_raw_entries(stored)
    assert [b"".join(bytes(p) for p in parts[i]) for i in (0, 1, 4)] == [expected[0], expected[1], expected[3]]
    assert isinstance(parts[2], InvalidRequest) and "checksum" in str(parts[2])
    assert isinstance(parts[3], InvalidRequest) and "decompress" in str(parts[3])

    outs = [bytearray(decoded_size(good[0])) for _ in stored]
    outs[4] = bytearray(len(outs[4]) - 1)  # the wrong size
    errors = to_raw_entries_into(stored, [memoryview(o) for o in outs])
    assert [bytes(outs[i]) for i in (0, 1)] == [expected[0], expected[1]] and errors[:2] == [None, None]
    assert "checksum" in str(errors[2]) and "decompress" in str(errors[3]) and "buffer for an entry" in str(errors[4])


# ---- format version 2: codec and checksum ids ------------------------------------------------


def _v1_entry(values: np.ndarray) -> bytes:
    """A version 1 entry (n as uint16, zlib CRC32), as the format before codec and checksum ids wrote it."""
    spec = TensorSpec(DType.float32, values.shape)
    dims = struct.pack("<BB", int(spec.dtype), len(spec.shape)) + struct.pack(f"<{len(spec.shape)}Q", *spec.shape)
    header_len = (28 + len(dims) + 15) // 16 * 16
    tail = dims + bytes(header_len - 28 - len(dims))
    payload = values.tobytes()
    head = struct.pack("<4sBBHQQ", b"ACE1", 1, 0, 1, len(payload), len(payload))
    crc = zlib.crc32(payload, zlib.crc32(tail, zlib.crc32(head)))
    return head + struct.pack("<I", crc) + tail + payload


@pytest.mark.parametrize("checksum", list(Checksum))
@pytest.mark.parametrize("encoding", ["raw", "lz4", "zstd", "zstd:-5", "auto"])
def test_every_codec_and_checksum_round_trips_and_detects_a_flipped_byte(encoding, checksum):
    sparse = np.maximum(np.random.default_rng(1).standard_normal((16, 16, 16), dtype=np.float32) - 0.5, 0)
    how = dataclasses.replace(Encoding.parse(encoding), checksum=checksum)
    stored = encode_entry([TensorSpec(DType.float32, sparse.shape)], [sparse], encoding=how)
    header, raw = decode_entry(stored)
    assert header.checksum == checksum
    assert np.array_equal(np.frombuffer(raw, np.float32).reshape(sparse.shape), sparse)
    served = b"".join(bytes(p) for p in to_raw_entry(stored))
    assert np.array_equal(np.frombuffer(decode_entry(served)[1], np.float32).reshape(sparse.shape), sparse)
    for position in (5, 30, len(stored) - 1):  # the codec id, the dims, the payload
        bad = bytearray(stored)
        bad[position] ^= 1
        with pytest.raises(InvalidRequest):
            decode_entry(bytes(bad))


def test_version_1_entries_stay_readable():
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    old = _v1_entry(values)
    header = verify_entry(old)
    assert (header.codec, header.checksum) == (Codec.raw, Checksum.crc32)
    assert np.array_equal(np.frombuffer(decode_entry(old)[1], np.float32).reshape(2, 3, 4), values)
    assert decoded_size(old) == served_size(old) == len(old)
    bad = bytearray(old)
    bad[-1] ^= 1
    with pytest.raises(InvalidRequest, match=r"checksum \(crc32\) mismatch"):
        verify_entry(bytes(bad))


def test_unknown_ids_and_encodings_are_named():
    stored = bytearray(encode_entry([TensorSpec(DType.float32, (4,))], [np.ones(4, np.float32)]))
    for unknown in (1, 9):  # 1 is not used (a retired checksum)
        stored[6] = unknown
        with pytest.raises(InvalidRequest, match=f"unknown checksum {unknown}; known: .*'xxh3'"):
            parse_header(bytes(stored))
    stored[6], stored[5] = 0, 7
    with pytest.raises(InvalidRequest, match="unknown codec 7; known: .*'lz4'"):
        parse_header(bytes(stored))
    stored[5], stored[4] = 0, 3
    with pytest.raises(InvalidRequest, match="version 3; expected .* version 1 or 2"):
        parse_header(bytes(stored))
    for text in ("gzip", "lz4:3", "raw_verified", "zstd:x"):
        with pytest.raises(InvalidRequest, match=f"unknown encoding '{text}'; use auto, raw, lz4"):
            Encoding.parse(text)
    with pytest.raises(InvalidRequest, match="-7..22"):
        Encoding.parse("zstd:40")


def test_auto_compresses_sparse_maps_and_leaves_dense_states_raw():
    relu = np.maximum(np.random.default_rng(2).standard_normal((32, 16, 16), dtype=np.float32), 0)
    hidden = np.random.default_rng(3).standard_normal((40, 384), dtype=np.float32)  # a transformer state: dense
    auto = Encoding.parse("auto")
    sparse_entry = encode_entry([TensorSpec(DType.float32, relu.shape)], [relu], encoding=auto)
    dense_entry = encode_entry([TensorSpec(DType.float32, hidden.shape)], [hidden], encoding=auto)
    assert parse_header(sparse_entry).codec == Codec.lz4
    assert len(sparse_entry) < relu.nbytes * (1 - AUTO_MIN_SAVING)
    assert parse_header(dense_entry).codec == Codec.raw


@pytest.mark.parametrize("checksum", list(Checksum))
def test_raw_entries_of_one_layout_are_served_like_any_others(checksum):
    arrays = [np.random.default_rng(i).standard_normal((4, 6), dtype=np.float32) for i in range(6)]
    how = Encoding(checksum=checksum)
    entries = [encode_entry([TensorSpec(DType.float32, a.shape)], [a], encoding=how) for a in arrays]
    bad = bytearray(entries[3])
    bad[-2] ^= 1  # the payload of one entry in the middle
    entries[3] = bytes(bad)
    outs = [memoryview(bytearray(decoded_size(e))) for e in entries]
    errors = to_raw_entries_into(entries, outs)
    assert [e is None for e in errors] == [True, True, True, False, True, True]
    assert "checksum" in str(errors[3])
    for i in (0, 1, 2, 4, 5):  # as served one by one
        assert bytes(outs[i]) == b"".join(bytes(p) for p in to_raw_entry(entries[i]))
    mixed = entries[:2] + [encode_entry([TensorSpec(DType.float32, (5, 6))], [np.zeros((5, 6), np.float32)])]
    outs = [memoryview(bytearray(decoded_size(e))) for e in mixed]
    assert to_raw_entries_into(mixed, outs) == [None, None, None]  # another layout: entry by entry
    assert bytes(outs[2]) == mixed[2]


@pytest.mark.parametrize("checksum", list(Checksum))
def test_a_run_of_raw_entries_is_copied_into_consecutive_rows_and_each_copy_is_verified(checksum):
    arrays = [np.random.default_rng(i).standard_normal((4, 6), dtype=np.float32) for i in range(6)]
    entries = [encode_entry([TensorSpec(DType.float32, a.shape)], [a], encoding=Encoding(checksum=checksum)) for a in arrays]
    size = len(entries[0])
    bad = bytearray(entries[4])
    bad[-3] ^= 0x10  # one payload bit
    entries[4] = bytes(bad)
    dest = memoryview(bytearray(6 * size))
    errors = copy_raw_run(entries, dest)
    assert [e is None for e in errors] == [True, True, True, True, False, True]
    assert f"checksum ({checksum.name}) mismatch" in str(errors[4])
    for i in (0, 1, 2, 3, 5):
        assert bytes(dest[i * size : (i + 1) * size]) == entries[i]
    # another layout of the same size, and a damaged first header: verified row by row
    other = encode_entry([TensorSpec(DType.float32, (6, 4))], [arrays[0].reshape(6, 4)], encoding=Encoding(checksum=checksum))
    assert len(other) == size
    assert copy_raw_run([entries[0], other, entries[1]], memoryview(bytearray(3 * size))) == [None, None, None]
    broken = bytearray(entries[0])
    broken[0] ^= 0xFF  # the magic
    errors = copy_raw_run([bytes(broken), entries[1]], memoryview(bytearray(2 * size)))
    assert errors[0] is not None and "magic" in str(errors[0]) and errors[1] is None


@pytest.mark.parametrize("checksum", list(Checksum))
def test_raw_entries_are_copied_as_columns_and_each_entry_is_verified(checksum):
    rng = np.random.default_rng(0)
    tensors = [(rng.standard_normal((3, 5), dtype=np.float32), rng.integers(0, 9, 7).astype(np.int64),
                rng.integers(0, 2, 3).astype(bool)) for _ in range(5)]
    specs = [TensorSpec(DType.float32, (3, 5)), TensorSpec(DType.int64, (7,)), TensorSpec(DType.bool, (3,))]
    entries = [encode_entry(specs, list(t), encoding=Encoding(checksum=checksum)) for t in tensors]
    bad = bytearray(entries[2])
    bad[-1] ^= 0x01  # one payload bit, in the last tensor
    entries[2] = bytes(bad)
    layout = parse_header(entries[0])
    columns = [memoryview(bytearray(5 * s.nbytes)) for s in specs]
    errors = copy_raw_columns(entries, layout, columns)
    assert [e is None for e in errors] == [True, True, False, True, True]
    assert f"checksum ({checksum.name}) mismatch" in str(errors[2])
    for j, column in enumerate(columns):
        got = np.frombuffer(column, tensors[0][j].dtype).reshape(5, *tensors[0][j].shape)
        for i in (0, 1, 3, 4):
            assert np.array_equal(got[i], tensors[i][j])


def test_served_size_is_what_fetch_serves_and_a_malformed_entry_keeps_its_size():
    relu = np.maximum(np.random.default_rng(0).standard_normal((16, 32, 8)), 0).astype(np.float32)
    raw = encode_entry([TensorSpec(DType.float32, relu.shape)], [relu])
    packed = compress_entry(raw, Encoding(Codec.lz4))
    assert parse_header(packed).codec == Codec.lz4 and len(packed) < len(raw)
    for entry in (raw, packed):
        assert served_size(entry) == len(b"".join(to_raw_entry(entry))) == decoded_size(entry)
    assert served_size(memoryview(raw)) == len(raw)
    for bad in (b"", b"ACE1", packed[:40]):  # too short for its header, or a header without its payload
        with pytest.raises(InvalidRequest):
            to_raw_entry(bad)
        assert served_size(bad) == len(bad)


def test_encode_batch_is_encode_entry_of_each_row_byte_for_byte():
    from actcache.codec import encode_batch

    rng = np.random.default_rng(0)
    for specs in ([TensorSpec(DType.float32, (4, 3))],
                  [TensorSpec(DType.float16, (5,)), TensorSpec(DType.int64, (2,))],  # padding between tensors
                  [TensorSpec(DType.uint8, (16,)), TensorSpec(DType.float32, (0,)), TensorSpec(DType.int32, (4,))]):
        columns = [rng.integers(0, 255, (5, s.nbytes), dtype=np.uint8) for s in specs]
        rows = encode_batch(specs, columns)
        assert [bytes(r) for r in rows] == [encode_entry(specs, [c[i] for c in columns]) for i in range(5)]
        assert all(verify_entry(r).specs == tuple(specs) for r in rows)
    assert encode_batch([TensorSpec(DType.float32, (2,))], [np.empty((0, 8), np.uint8)]).shape[0] == 0
    with pytest.raises(InvalidRequest, match=r"tensor 0: a uint8\[2, 4\] column for 2 entries of 8 bytes"):
        encode_batch([TensorSpec(DType.float32, (2,))], [np.zeros((2, 4), np.uint8)])
