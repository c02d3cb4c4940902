import numpy as np
import pytest

from actcache.errors import InvalidRequest
from actcache.keys import (
    GENERATION_PREFIX_BYTES,
    GROUP_PREFIX_BYTES,
    KEY_BYTES,
    encode_key,
    encode_keys,
    fingerprint_of,
    generation_of,
    group_of,
    group_prefix,
    namespace_id_of,
    namespace_of,
    sample_id_of,
    sample_ids_of,
    split_group,
)

FP = bytes(range(16))


def test_keys_are_fixed_width_ordered_and_grouped():
    keys = [encode_key(1, FP, 2, sample) for sample in (0, 1, 255, 256, 2**40)]
    assert all(len(k) == KEY_BYTES for k in keys)
    assert keys == sorted(keys)
    assert all(k.startswith(group_prefix(1, FP, 2)) for k in keys)
    assert not encode_key(1, FP, 3, 0).startswith(group_prefix(1, FP, 2))
    assert sample_id_of(encode_key(7, FP, 9, 123, 4)) == 123


@pytest.mark.parametrize(
    "args, message",
    [((1, b"short", 0, 0), "16 bytes"), ((1, FP, 70000, 0), "depth"), ((1, FP, 0, -1), "sample_id"),
     ((2**33, FP, 0, 0), "namespace_id"), ((1, FP, 0, 0, 2**17), "variant")],
)
def test_out_of_range_fields_are_named(args, message):
    with pytest.raises(InvalidRequest, match=message):
        encode_key(*args)


def test_encode_keys_matches_encode_key():
    ids = np.array([0, 1, 255, 2**40, 2**64 - 1], np.uint64)
    variants = np.array([0, 7, 65535, 1, 2], np.uint16)
    for fp in (FP, bytes(16), b"\x01" + bytes(15)):
        assert encode_keys(9, fp, 3, ids, variants) == [encode_key(9, fp, 3, int(i), int(v)) for i, v in zip(ids, variants)]
        assert encode_keys(9, fp, 3, ids) == [encode_key(9, fp, 3, int(i)) for i in ids]
    with pytest.raises(InvalidRequest, match="2 variants for 5 sample ids"):
        encode_keys(9, FP, 3, ids, variants[:2])


def test_sample_ids_of_reads_back_what_encode_keys_packed():
    ids = np.array([0, 1, 255, 2**40, 2**64 - 1], np.uint64)
    variants = np.array([0, 7, 65535, 1, 2], np.uint16)
    got_ids, got_variants = sample_ids_of(encode_keys(9, FP, 3, ids, variants))
    assert got_ids.dtype == np.uint64 and got_variants.dtype == np.uint16
    assert got_ids.tolist() == ids.tolist() and got_variants.tolist() == variants.tolist()


def test_the_parts_of_a_key_are_read_back_from_it_and_its_prefixes():
    key = encode_key(70_000, FP, 513, 2**40 + 3, 9)
    assert namespace_of(key) == group_prefix(70_000)
    assert generation_of(key) == group_prefix(70_000, FP) and len(generation_of(key)) == GENERATION_PREFIX_BYTES
    assert group_of(key) == group_prefix(70_000, FP, 513) and len(group_of(key)) == GROUP_PREFIX_BYTES
    for head in (key, group_of(key), generation_of(key)):
        assert namespace_id_of(head) == 70_000 and fingerprint_of(head) == FP
    assert split_group(group_of(key)) == (70_000, FP, 513)
    assert sample_id_of(key) == 2**40 + 3
