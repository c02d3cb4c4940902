import pytest

from actcache.errors import InvalidRequest
from actcache.keys import KEY_BYTES, EntryKey, encode_key, group_prefix

FP = bytes(range(16))


def test_keys_are_fixed_width_ordered_and_grouped():
    keys = [encode_key(1, FP, 2, sample) for sample in (0, 1, 255, 256, 2**40)]
    assert all(len(k) == KEY_BYTES for k in keys)
    assert keys == sorted(keys)
    assert all(k.startswith(group_prefix(1, FP, 2)) for k in keys)
    assert not encode_key(1, FP, 3, 0).startswith(group_prefix(1, FP, 2))
    assert EntryKey.decode(encode_key(7, FP, 9, 123, 4)) == EntryKey(7, FP, 9, 123, 4)


@pytest.mark.parametrize(
    "args, message",
    [((1, b"short", 0, 0), "16 bytes"), ((1, FP, 70000, 0), "depth"), ((1, FP, 0, -1), "sample_id"),
     ((2**33, FP, 0, 0), "namespace_id"), ((1, FP, 0, 0, 2**17), "variant")],
)
def test_out_of_range_fields_are_named(args, message):
    with pytest.raises(InvalidRequest, match=message):
        encode_key(*args)
