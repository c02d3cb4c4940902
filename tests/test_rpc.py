"""The hand-written Frame encoding (actcache.rpc) against the generated ``pb.Frame``: what one writes the
other reads, field for field, and both write the same bytes whenever the header is not empty."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actcache._proto import actcache_pb2 as pb
from actcache.rpc import decode_frame, encode_frame

# Lengths on each side of the varint's 1-, 2- and 3-byte boundaries.
SIZES = [0, 1, 127, 128, 16383, 16384, (1 << 21) + 3]


def _bytes(n: int, seed: int) -> bytes:
    return bytes((seed + 31 * i) % 256 for i in range(n))


@pytest.mark.parametrize("header_size", SIZES[:-1])
@pytest.mark.parametrize("payload_size", SIZES)
def test_encode_frame_is_the_generated_encoding(header_size: int, payload_size: int) -> None:
    header, payload = _bytes(header_size, 1), _bytes(payload_size, 2)
    parts = [payload[: payload_size // 3], memoryview(payload)[payload_size // 3 :]]  # bytes and views alike
    ours = encode_frame(header, parts)

    parsed = pb.Frame.FromString(ours)
    assert (parsed.header, parsed.payload) == (header, payload)
    generated = pb.Frame(header=header, payload=payload).SerializeToString()
    if header:
        assert ours == generated
    else:  # proto3 leaves an empty field out; encode_frame writes it with length 0: both parse the same
        assert ours == b"\x0a\x00" + generated

    for wire in (ours, generated):
        got_header, got_payload = decode_frame(wire)
        assert (bytes(got_header), bytes(got_payload)) == (header, payload)


@settings(max_examples=60, deadline=None)
@given(header=st.binary(max_size=300), parts=st.lists(st.binary(max_size=300), max_size=4))
def test_frames_round_trip_both_ways(header: bytes, parts: list[bytes]) -> None:
    payload = b"".join(parts)
    frame = pb.Frame.FromString(encode_frame(header, parts))
    assert (frame.header, frame.payload) == (header, payload)
    got = decode_frame(pb.Frame(header=header, payload=payload).SerializeToString())
    assert (bytes(got[0]), bytes(got[1])) == (header, payload)
