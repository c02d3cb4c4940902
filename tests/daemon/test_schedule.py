"""Assembling pushed orders from chunks."""

import numpy as np
import pytest

from actcache.daemon.prefetch._schedule import ScheduleBuilder, unpack_ids, unpack_variants
from actcache.errors import InvalidRequest
from actcache.keys import encode_key

FP = b"S" * 16


def test_chunks_concatenate_and_variants_fill_with_zero():
    b = ScheduleBuilder()
    b.add(3, FP, 2, "rank1-epoch7", unpack_ids([5, 6], b""), None)
    b.add(0, b"", 0, "", unpack_ids([], np.array([7, 2**64 - 1], "<u8").tobytes()), None)
    b.add(0, b"", 0, "", unpack_ids([8], b""), unpack_variants([4], b"", 1))
    s = b.build()
    assert (s.namespace_id, s.schedule_id, s.fingerprint, s.depth) == (3, "rank1-epoch7", FP, 2)
    assert s.sample_ids.dtype == np.uint64 and s.sample_ids.tolist() == [5, 6, 7, 2**64 - 1, 8]
    assert s.variants.tolist() == [0, 0, 0, 0, 4]
    assert s.keys(3, 5) == [encode_key(3, FP, 2, 2**64 - 1), encode_key(3, FP, 2, 8, 4)]


def test_all_zero_variants_are_dropped_and_empty_schedules_are_fine():
    b = ScheduleBuilder()
    b.add(1, FP, 0, "e", unpack_ids([1], b""), unpack_variants([], np.zeros(1, "<u2").tobytes(), 1))
    assert b.build().variants is None
    b = ScheduleBuilder()
    b.add(1, FP, 0, "empty", unpack_ids([], b""), None)
    assert len(b.build()) == 0


@pytest.mark.parametrize("call, message", [
    (lambda: unpack_ids([1], b"\0" * 8), "both sample_ids and packed_sample_ids"),
    (lambda: unpack_ids([], b"\0" * 7), "not a multiple of 8"),
    (lambda: unpack_variants([1, 2], b"", 3), "2 variants for 3 sample ids"),
    (lambda: unpack_variants([70000], b"", 1), "variant 70000 is out of range"),
    (lambda: ScheduleBuilder().build(), "carried no chunk"),
    (lambda: ScheduleBuilder().add(1, FP, 0, "a b", np.zeros(0, np.uint64), None), "schedule id 'a b' is invalid"),
    (lambda: ScheduleBuilder().add(1, b"x", 0, "a", np.zeros(0, np.uint64), None), "fingerprint must be 16 bytes"),
])
def test_malformed_chunks_are_named(call, message):
    with pytest.raises(InvalidRequest, match=message):
        call()


def test_a_chunk_may_not_change_the_schedule():
    b = ScheduleBuilder()
    b.add(1, FP, 2, "a", np.zeros(1, np.uint64), None)
    with pytest.raises(InvalidRequest, match="changes depth from 2 to 3"):
        b.add(1, FP, 3, "a", np.zeros(1, np.uint64), None)
