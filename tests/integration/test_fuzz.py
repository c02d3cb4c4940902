"""Property-based fuzzing of every RPC against one live daemon.

Each example sends a request built from random fields (wrong sizes, dtypes,
shapes, ids, negative/huge values, giant id lists, truncated or garbage
frames), or random bytes as the serialized request of a method, or random
bytes on the raw socket. Properties: the daemon answers only with the
documented status codes for the method (never INTERNAL or UNKNOWN), its
process stays alive and healthy, and its RSS stays bounded. The figures
(examples per test, RSS before/after) are printed at the end of the module.
"""

import os
import socket
import struct
import threading

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actcache._proto import actcache_pb2 as pb
from actcache.codec import DType, TensorSpec, encode_entry
from actcache.rpc import encode_frame, method
from actcache.testing import run_daemon

OK = grpc.StatusCode.OK
DOCUMENTED = {
    OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
}
# Prefetch methods may still answer UNIMPLEMENTED in this version.
ALLOWED = {name: DOCUMENTED for name in ("Open", "Put", "Get", "Drop", "Stats")}
ALLOWED.update({name: DOCUMENTED | {grpc.StatusCode.UNIMPLEMENTED} for name in ("Schedule", "Fetch")})
RSS_LIMIT_BYTES = 512 << 20  # generous: the daemon runs near 100 MB here
FUZZ = settings(max_examples=int(os.environ.get("ACTCACHE_FUZZ_EXAMPLES", 150)), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FIGURES: dict[str, int] = {}
_identity = lambda x: x  # noqa: E731

u32 = st.integers(0, 2**32 - 1)
u64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1]))
fingerprints = st.one_of(st.just(bytes(range(16))), st.binary(max_size=40))


@pytest.fixture(scope="module")
def fuzzed():
    with run_daemon("--zstd-level", "1", "--namespace-budget", "8MiB", "--max-entry-bytes", "1MiB") as daemon:
        channel = grpc.insecure_channel(daemon.target, [("grpc.max_receive_message_length", -1),
                                                        ("grpc.max_send_message_length", -1)])
        proc = psutil.Process(daemon.pid)
        FIGURES["rss_start"] = FIGURES["rss_max"] = proc.memory_info().rss
        stop = threading.Event()

        def sample() -> None:  # a measurement, not a wait: peaks inside a call count too
            while not stop.wait(0.02):
                FIGURES["rss_max"] = max(FIGURES["rss_max"], proc.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        public = pb.OpenReply.FromString(
            channel.unary_unary(method("Open"), request_serializer=_identity, response_deserializer=_identity)(
                pb.OpenRequest(name="fuzz", create=True).SerializeToString(), timeout=10))
        protected = pb.OpenReply.FromString(
            channel.unary_unary(method("Open"), request_serializer=_identity, response_deserializer=_identity)(
                pb.OpenRequest(name="fuzz-secret", create=True, secret=b"s").SerializeToString(), timeout=10))
        yield daemon, channel, [public.namespace_id, protected.namespace_id]
        FIGURES["rss_end"] = proc.memory_info().rss
        stop.set()
        sampler.join()
        channel.close()
        print(f"\nfuzz figures: {FIGURES}")


def namespaces(fuzzed):
    return st.one_of(st.sampled_from(fuzzed[2]), u64)


def call(channel, name: str, payload, *, stream_request=False, stream_response=False) -> grpc.StatusCode:
    """Send ``payload`` (bytes, or a list of bytes for streamed requests) to ``name``; return the status."""
    path = method(name)
    try:
        if stream_request:
            channel.stream_unary(path, request_serializer=_identity, response_deserializer=_identity)(
                iter(payload), timeout=30)
        elif stream_response:
            for _ in channel.unary_stream(path, request_serializer=_identity, response_deserializer=_identity)(
                    payload, timeout=30):
                pass
        else:
            channel.unary_unary(path, request_serializer=_identity, response_deserializer=_identity)(payload, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED[name], f"{name} answered {exc.code().name}: {exc.details()}"
        return exc.code()
    return OK


def check_alive(fuzzed, test: str) -> None:
    daemon, channel, _ = fuzzed
    assert daemon.proc is not None and daemon.proc.poll() is None, f"daemon died during {test}\n{daemon.log_tail()}"
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    rss = FIGURES["rss_max"] = max(FIGURES["rss_max"], psutil.Process(daemon.pid).memory_info().rss)
    assert rss < RSS_LIMIT_BYTES, f"daemon RSS reached {rss} bytes by the end of {test}"
    assert "Traceback" not in daemon.log_tail(400), daemon.log_tail(80)


def count(test: str) -> None:
    FIGURES[test] = FIGURES.get(test, 0) + 1


# ---- structured requests with random fields ----------------------------------


@FUZZ
@given(data=st.data())
def test_open(fuzzed, data):
    name = data.draw(st.one_of(st.text(max_size=140), st.from_regex(r"[A-Za-z0-9._-]{1,8}", fullmatch=True)))
    secret = data.draw(st.one_of(st.just(b""), st.binary(min_size=1, max_size=1100)))
    request = pb.OpenRequest(name=name, create=data.draw(st.booleans()), secret=secret)
    call(fuzzed[1], "Open", request.SerializeToString())
    count("open")


@st.composite
def entries(draw):
    """Valid entries, mutated entries (flipped, truncated, extended bytes) and garbage."""
    specs = draw(st.lists(st.builds(TensorSpec, st.sampled_from(list(DType)),
                                    st.lists(st.integers(0, 40), max_size=3).map(tuple)), min_size=1, max_size=3))
    value = bytearray(encode_entry(specs, [bytes(s.nbytes) for s in specs]))
    kind = draw(st.sampled_from(["valid", "flip", "truncate", "extend", "garbage", "header"]))
    if kind == "flip":
        at = draw(st.integers(0, len(value) - 1))
        value[at] ^= draw(st.integers(1, 255))
    elif kind == "truncate":
        value = value[: draw(st.integers(0, len(value) - 1))]
    elif kind == "extend":
        value += draw(st.binary(min_size=1, max_size=64))
    elif kind == "garbage":
        value = bytearray(draw(st.binary(max_size=2048)))
    elif kind == "header":  # huge / odd header numbers
        at = draw(st.sampled_from([5, 6, 8, 16, 28, 29, 30]))
        value[at : at + 8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))[: len(value[at : at + 8])]
    return bytes(value)


@FUZZ
@given(data=st.data())
def test_put(fuzzed, data):
    frames = []
    for _ in range(data.draw(st.integers(0, 3))):
        values = data.draw(st.lists(entries(), max_size=6))
        ids = data.draw(st.lists(u64, min_size=len(values), max_size=len(values) + 2))
        lengths = data.draw(st.one_of(st.just([len(v) for v in values]), st.lists(u64, max_size=8)))
        header = pb.PutHeader(
            namespace_id=data.draw(namespaces(fuzzed)), fingerprint=data.draw(fingerprints),
            depth=data.draw(u32), sample_ids=ids, lengths=lengths,
            variants=data.draw(st.one_of(st.just([]), st.lists(u32, max_size=8))),
        )
        frame = encode_frame(header.SerializeToString(), values)
        shape = data.draw(st.sampled_from(["whole", "truncated", "garbage", "garbage-header"]))
        if shape == "truncated":
            frame = frame[: data.draw(st.integers(0, max(0, len(frame) - 1)))]
        elif shape == "garbage":
            frame = data.draw(st.binary(max_size=4096))
        elif shape == "garbage-header":
            frame = encode_frame(data.draw(st.binary(max_size=64)), values)
        frames.append(frame)
    call(fuzzed[1], "Put", frames, stream_request=True)
    count("put")


@FUZZ
@given(data=st.data())
def test_get(fuzzed, data):
    request = pb.GetRequest(
        namespace_id=data.draw(namespaces(fuzzed)), fingerprint=data.draw(fingerprints), depth=data.draw(u32),
        sample_ids=data.draw(st.lists(u64, max_size=64)), variants=data.draw(st.lists(u32, max_size=64)),
    )
    call(fuzzed[1], "Get", request.SerializeToString(), stream_response=True)
    count("get")


@FUZZ
@given(data=st.data())
def test_drop_and_stats(fuzzed, data):
    request = pb.DropRequest(namespace_id=data.draw(namespaces(fuzzed)), fingerprint=data.draw(fingerprints))
    if data.draw(st.booleans()):
        request.depth = data.draw(u32)
    call(fuzzed[1], "Drop", request.SerializeToString())
    call(fuzzed[1], "Stats", pb.StatsRequest().SerializeToString())
    count("drop+stats")


@FUZZ
@given(data=st.data())
def test_schedule_and_fetch(fuzzed, data):
    chunks = [
        pb.ScheduleChunk(
            namespace_id=data.draw(namespaces(fuzzed)), fingerprint=data.draw(fingerprints), depth=data.draw(u32),
            schedule_id=data.draw(st.text(max_size=40)), sample_ids=data.draw(st.lists(u64, max_size=64)),
            variants=data.draw(st.lists(u32, max_size=8)),
        ).SerializeToString()
        for _ in range(data.draw(st.integers(0, 3)))
    ]
    call(fuzzed[1], "Schedule", chunks, stream_request=True)
    fetch = pb.FetchRequest(namespace_id=data.draw(namespaces(fuzzed)), schedule_id=data.draw(st.text(max_size=40)),
                            start=data.draw(u64))
    call(fuzzed[1], "Fetch", fetch.SerializeToString(), stream_response=True)
    count("schedule+fetch")


# ---- random bytes as the serialized request of every method ------------------


@FUZZ
@given(name=st.sampled_from(sorted(ALLOWED)), payload=st.lists(st.binary(max_size=512), min_size=1, max_size=3))
def test_random_bytes_as_requests(fuzzed, name, payload):
    streaming_request = name in ("Put", "Schedule")
    streaming_response = name in ("Get", "Fetch")
    code = call(fuzzed[1], name, payload if streaming_request else payload[0],
                stream_request=streaming_request, stream_response=streaming_response)
    FIGURES.setdefault("random-bytes statuses", set()).add(code.name)
    count("random-bytes")


# ---- random bytes on the raw socket ------------------------------------------


@settings(max_examples=60, deadline=None, database=None)
@given(preface=st.booleans(), garbage=st.binary(min_size=1, max_size=4096))
def test_random_bytes_on_the_socket(fuzzed, preface, garbage):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(2)
        raw.connect(str(fuzzed[0].socket))
        try:
            raw.sendall((b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" if preface else b"") + garbage)
            raw.recv(4096)
        except OSError:  # the daemon closing the connection is the expected answer
            pass
    count("raw-socket")


# ---- giant requests ------------------------------------------------------------


def test_giant_id_lists(fuzzed):
    _, channel, (public, _) = fuzzed
    fp = bytes(range(16))
    too_many = pb.GetRequest(namespace_id=public, fingerprint=fp, sample_ids=range((1 << 20) + 1))
    assert call(channel, "Get", too_many.SerializeToString(), stream_response=True) == grpc.StatusCode.INVALID_ARGUMENT
    misses = pb.GetRequest(namespace_id=public, fingerprint=fp, sample_ids=range(1 << 20))
    assert call(channel, "Get", misses.SerializeToString(), stream_response=True) == OK
    huge = pb.ScheduleChunk(namespace_id=public, fingerprint=fp, schedule_id="giant", sample_ids=range(1 << 20))
    call(channel, "Schedule", [huge.SerializeToString()] * 4, stream_request=True)
    count("giant")


def test_large_entries_within_and_beyond_limits(fuzzed):
    _, channel, (public, _) = fuzzed
    fp = bytes(range(16))
    big = encode_entry([TensorSpec(DType.uint8, (2 << 20,))], [os.urandom(2 << 20)])  # above --max-entry-bytes
    header = pb.PutHeader(namespace_id=public, fingerprint=fp, depth=9, sample_ids=[1], lengths=[len(big)])
    frame = encode_frame(header.SerializeToString(), [big])
    assert call(channel, "Put", [frame], stream_request=True) == grpc.StatusCode.INVALID_ARGUMENT
    fits = encode_entry([TensorSpec(DType.uint8, (900 << 10,))], [os.urandom(900 << 10)])
    codes = set()
    for i in range(12):  # 10.8 MB of entries into an 8 MiB namespace budget
        header = pb.PutHeader(namespace_id=public, fingerprint=fp, depth=9, sample_ids=[i], lengths=[len(fits)])
        codes.add(call(channel, "Put", [encode_frame(header.SerializeToString(), [fits])], stream_request=True))
    assert codes == {OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    # 700 ids naming one 900 KiB entry: 630 MB if the daemon gathered them before sending.
    many = pb.GetRequest(namespace_id=public, fingerprint=fp, depth=9, sample_ids=[0] * 700)
    chunks = channel.unary_stream(method("Get"), request_serializer=_identity, response_deserializer=_identity)(
        many.SerializeToString(), timeout=60)
    assert sum(len(c) for c in chunks) > 700 * len(fits)
    count("large")


@pytest.fixture(autouse=True)
def _alive_after_each_test(request, fuzzed):
    yield
    check_alive(fuzzed, request.node.name)
