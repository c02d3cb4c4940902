"""Property-based fuzzing of every RPC against one live daemon.

Each example sends a request built from random fields (wrong sizes, dtypes,
shapes, ids, negative/huge values, giant id lists, truncated or garbage
frames), or random bytes as the serialized request of a method, or random
bytes on the raw socket. Properties: the daemon answers only with the
documented status codes for the method (never INTERNAL or UNKNOWN), its
process stays alive and healthy, and its RSS stays bounded. The figures
(examples per test, RSS before/after) are printed at the end of the module.

Schedule and Fetch are also fuzzed structurally, against a model: a valid
Schedule stream with at most one defect (inconsistent chunk fields, a chunk
for another namespace or schedule mid-stream, an empty stream, ...) must get
the exact status documented for that defect, and afterwards the schedule id
holds the new order (success), or what it held before (a failed push changes
nothing); Fetch requests with any start, namespace, schedule, data plane,
ring size and frame size, some cancelled mid-stream and resumed, must get
their exact status and exactly the model's entries. Giant schedules, Schedule
uploads cancelled midway and Fetches cancelled mid-stream have tests of their
own. After each of these examples a normal put/Schedule/Fetch round trip
must still work, and no shared-memory segment may be left behind.
"""

import collections
import contextlib
import itertools
import os
import re
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actcache._proto import actcache_pb2 as pb
from actcache.codec import DType, TensorSpec, decode_entry, encode_entry
from actcache.daemon.prefetch import MAX_SCHEDULES_PER_NAMESPACE
from actcache.errors import ActCacheError
from actcache.keys import MAX_DEPTH
from actcache.rpc import PROTOCOL_VERSION, encode_frame, method
from actcache.rpc_client import RpcClient
from actcache.testing import run_daemon, wait_until
from tests.integration.conftest import fetched, holds_its_tensor, put_range, segments, tensor_of

OK = grpc.StatusCode.OK
DOCUMENTED = {
    OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
}
ALLOWED = {name: DOCUMENTED for name in ("Open", "Put", "Get", "Drop", "Stats", "Schedule", "Fetch")}
ALLOWED["Open"] = DOCUMENTED | {grpc.StatusCode.FAILED_PRECONDITION}  # another wire protocol (VersionMismatch)
RSS_LIMIT_BYTES = 512 << 20  # generous: the daemon runs near 100 MB here
FUZZ = settings(max_examples=int(os.environ.get("ACTCACHE_FUZZ_EXAMPLES", 150)), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FIGURES: dict[str, int] = {}
_identity = lambda x: x  # noqa: E731

u32 = st.integers(0, 2**32 - 1)
u64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1]))
fingerprints = st.one_of(st.just(bytes(range(16))), st.binary(max_size=40))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    env = {"ACTCACHE_SHM_DIR": str(tmp_path_factory.mktemp("shm"))}
    # --prefetch-bytes bounds the read-ahead of the schedules the tests leave unfetched (default 512 MiB)
    with run_daemon("--encoding", "zstd", "--namespace-budget", "8MiB", "--max-entry-bytes", "1MiB",
                    "--prefetch-bytes", "64MiB", env=env) as daemon:
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
                pb.OpenRequest(name="fuzz", create=True, protocol_version=PROTOCOL_VERSION).SerializeToString(),
                timeout=10))
        protected = pb.OpenReply.FromString(
            channel.unary_unary(method("Open"), request_serializer=_identity, response_deserializer=_identity)(
                pb.OpenRequest(name="fuzz-secret", create=True, secret=b"s",
                               protocol_version=PROTOCOL_VERSION).SerializeToString(), timeout=10))
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
            collections.deque(channel.unary_stream(path, request_serializer=_identity, response_deserializer=_identity)(
                payload, timeout=30), maxlen=0)  # read the whole stream
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
@pytest.mark.slow
def test_open(fuzzed, data):
    name = data.draw(st.one_of(st.text(max_size=140), st.from_regex(r"[A-Za-z0-9._-]{1,8}", fullmatch=True)))
    secret = data.draw(st.one_of(st.just(b""), st.binary(min_size=1, max_size=1100)))
    protocol = data.draw(st.one_of(st.just(PROTOCOL_VERSION), st.integers(0, 2**32 - 1)))
    request = pb.OpenRequest(name=name, create=data.draw(st.booleans()), secret=secret, protocol_version=protocol,
                             client_version=data.draw(st.text(max_size=300)))
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
@pytest.mark.slow
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
@pytest.mark.slow
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
        with contextlib.suppress(OSError):  # the daemon closing the connection is the expected answer
            raw.sendall((b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" if preface else b"") + garbage)
            raw.recv(4096)
    count("raw-socket")


# ---- giant requests ------------------------------------------------------------


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---- Schedule and Fetch, structured, against a model --------------------------

FP = bytes(range(16))
STORED = 100  # ids 0..99 hold conftest.tensor_of(id) (1 KiB) at depth 1, variant 0
BIG_ID = 1000  # one entry of 100 KiB: more than the smallest shared-memory ring (64 KiB) holds
BIG_SPEC = [TensorSpec(DType.float32, (160, 160))]
UNSTORED = tuple(range(5000, 5008))
UNKNOWN_SMALL_ID = 2**31  # never opened (ids are handed out from 1)
RING_MIN = 64 << 10  # actcache.shm: a smaller ring_bytes is raised to this

# Each defect and the status documented for it (actcache/errors.py, daemon/schedule.py, the proto's
# ScheduleChunk: the first chunk names namespace, fingerprint, depth and schedule id; later chunks leave
# them unset or repeat them; ids and variants come repeated or packed, not both, one variant per id).
SCHEDULE_DEFECTS = {
    None: OK,
    "empty stream": grpc.StatusCode.INVALID_ARGUMENT,
    "variants length != ids length": grpc.StatusCode.INVALID_ARGUMENT,
    "packed ids not a multiple of 8 bytes": grpc.StatusCode.INVALID_ARGUMENT,
    "packed variants not a multiple of 2 bytes": grpc.StatusCode.INVALID_ARGUMENT,
    "ids both repeated and packed": grpc.StatusCode.INVALID_ARGUMENT,
    "variant above 65535": grpc.StatusCode.INVALID_ARGUMENT,
    "first chunk names no namespace": grpc.StatusCode.NOT_FOUND,
    "unknown namespace": grpc.StatusCode.NOT_FOUND,
    "protected namespace by its small id": grpc.StatusCode.PERMISSION_DENIED,
    "bad schedule id": grpc.StatusCode.INVALID_ARGUMENT,
    "bad fingerprint": grpc.StatusCode.INVALID_ARGUMENT,
    "depth out of range": grpc.StatusCode.INVALID_ARGUMENT,
    "other namespace mid-stream": grpc.StatusCode.INVALID_ARGUMENT,
    "other schedule id mid-stream": grpc.StatusCode.INVALID_ARGUMENT,
    "other fingerprint mid-stream": grpc.StatusCode.INVALID_ARGUMENT,
    "other depth mid-stream": grpc.StatusCode.INVALID_ARGUMENT,
}
FIRST_CHUNK_DEFECTS = {"first chunk names no namespace", "bad schedule id", "bad fingerprint", "depth out of range"}


def big_tensor() -> np.ndarray:
    return np.random.default_rng(BIG_ID).standard_normal((160, 160), dtype=np.float32)


@dataclass
class Prefetch:
    """Namespaces with known entries, and a client, for the Schedule/Fetch tests."""

    client: RpcClient
    channel: grpc.Channel
    shm: Path
    public: int  # handle of "pf-a": ids 0..99 and BIG_ID stored
    other: int  # handle of "pf-b": nothing stored
    protected: int  # handle of "fuzz-secret" (same entries as pf-a)
    protected_id: int  # its small id, which requests may not use
    round_trips: int  # handle of "pf-rt", where round_trip() puts
    counter: Iterator[int] = field(default_factory=itertools.count)

    def schedule_id(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"


@pytest.fixture(scope="module")
def pf(fuzzed):
    daemon, channel, (_, protected) = fuzzed
    with daemon.client(timeout_s=30, retries=0) as client:
        public, other, rt = (client.open(name).namespace_id for name in ("pf-a", "pf-b", "pf-rt"))
        protected_id = next(n.namespace_id for n in client.stats().namespaces if n.name == "fuzz-secret")
        big = encode_entry(BIG_SPEC, [big_tensor()])
        for ns in (public, protected):
            put_range(client, ns, range(STORED), fingerprint=FP)
            client.put(ns, FP, 1, [(BIG_ID, 0, big)])
        yield Prefetch(client, channel, Path(daemon.env["ACTCACHE_SHM_DIR"]), public, other, protected, protected_id,
                       rt)


def is_stored(sample_id: int, variant: int) -> bool:
    return variant == 0 and (sample_id < STORED or sample_id == BIG_ID)


def check_entries(got, order, variants, start: int = 0) -> None:
    """``got`` (from conftest.fetched) is positions ``start..`` of the model order, misses in place, bit-exact."""
    assert [(pos, sid, var) for pos, sid, var, _ in got] == [
        (start + i, int(s), int(v)) for i, (s, v) in enumerate(zip(order[start:], variants[start:]))]
    for _, sid, var, value in got:
        assert (value is not None) == is_stored(sid, var), (sid, var)
        if value is not None:
            want = big_tensor() if sid == BIG_ID else tensor_of(sid)
            assert bytes(decode_entry(value)[1]) == want.tobytes(), f"entry {sid} does not hold its tensor"


def push(channel, chunks) -> tuple[grpc.StatusCode, pb.ScheduleReply | None]:
    """Send a Schedule stream of ``chunks`` as they are; the status and the reply."""
    schedule = channel.stream_unary(method("Schedule"), request_serializer=pb.ScheduleChunk.SerializeToString,
                                    response_deserializer=pb.ScheduleReply.FromString)
    try:
        return OK, schedule(iter(chunks), timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), None


def code_of(exc: ActCacheError) -> grpc.StatusCode:
    """The gRPC status a client-side error came from (its message ends with ``[CODE]``)."""
    return grpc.StatusCode[re.search(r"\[(\w+)\]$", str(exc)).group(1)]


def fetch_status(pf: Prefetch, ns: int, schedule_id: str, **kwargs) -> tuple[grpc.StatusCode, list, set[str]]:
    """Status, entries received before it, and data planes of a whole Fetch."""
    got, planes = [], set()
    try:
        for batch in pf.client.fetch_batches(ns, schedule_id, **kwargs):
            planes.add(batch.data_plane)
            got.extend((pos, sid, var, None if v is None else bytes(v)) for pos, sid, var, v in batch)
    except ActCacheError as exc:
        return code_of(exc), got, planes
    return OK, got, planes


def round_trip(pf: Prefetch) -> None:
    """A normal put, Schedule and Fetch (bytes, then shared memory, in turn) still work."""
    n = next(pf.counter)
    ids = [10**6 + 2 * n, 10**6 + 2 * n + 1]
    put_range(pf.client, pf.round_trips, ids, fingerprint=FP)
    order = [ids[0], 10**7 + n, ids[1]]  # the middle one is a miss
    pf.client.schedule(pf.round_trips, FP, 1, f"rt{n}", order)
    got, planes = fetched(pf.client, pf.round_trips, f"rt{n}", shared_memory=n % 2 == 1)
    assert planes == {"shared_memory" if n % 2 else "bytes"}
    assert [sid for _, sid, _, _ in got] == order
    assert got[1][3] is None and holds_its_tensor(got[0][3], ids[0]) and holds_its_tensor(got[2][3], ids[1])


def settle(pf: Prefetch) -> None:
    """After an example: no segment is left (a cancelled stream's goes once the daemon sees the cancel), and a
    round trip works."""
    wait_until(lambda: segments(pf.shm) == [], what="no shared-memory segment left")
    round_trip(pf)


def _chunk_defect(data, kind: str, chunk: pb.ScheduleChunk, ids: list[int], pf: Prefetch, first_ns: int) -> None:
    """Make ``chunk`` (holding ``ids``) carry the defect ``kind``."""
    if kind == "variants length != ids length":
        n = data.draw(st.integers(1, len(ids) + 3).filter(lambda n: n != len(ids)))
        chunk.ClearField("variants")
        chunk.packed_variants = b""
        if data.draw(st.booleans()):
            chunk.packed_variants = np.zeros(n, "<u2").tobytes()
        else:
            chunk.variants.extend([0] * n)
    elif kind == "packed ids not a multiple of 8 bytes":
        chunk.ClearField("sample_ids")
        chunk.packed_sample_ids = np.array(ids, "<u8").tobytes() + bytes(data.draw(st.integers(1, 7)))
    elif kind == "packed variants not a multiple of 2 bytes":
        chunk.ClearField("variants")
        chunk.packed_variants = bytes(2 * len(ids) + 1)
    elif kind == "ids both repeated and packed":
        chunk.ClearField("sample_ids")
        chunk.sample_ids.extend(ids or [1])
        chunk.packed_sample_ids = np.array(ids or [1], "<u8").tobytes()
    elif kind == "variant above 65535":
        ids = ids or [1]
        chunk.ClearField("sample_ids")
        chunk.packed_sample_ids = np.array(ids, "<u8").tobytes()
        chunk.ClearField("variants")
        chunk.packed_variants = b""
        chunk.variants.extend([0] * (len(ids) - 1) + [data.draw(st.integers(2**16, 2**32 - 1))])
    elif kind == "first chunk names no namespace":
        chunk.namespace_id = 0
    elif kind == "unknown namespace":
        chunk.namespace_id = data.draw(st.sampled_from([UNKNOWN_SMALL_ID, 2**64 - 1, 2**40 + 12345]))
    elif kind == "protected namespace by its small id":
        chunk.namespace_id = pf.protected_id
    elif kind == "bad schedule id":
        chunk.schedule_id = data.draw(st.sampled_from(["", "x" * 129, "bad id!", "é", "a/b"]))
    elif kind == "bad fingerprint":
        chunk.fingerprint = data.draw(st.binary(max_size=40).filter(lambda b: len(b) != 16))
    elif kind == "depth out of range":
        chunk.depth = data.draw(st.integers(MAX_DEPTH + 1, 2**32 - 1))
    elif kind == "other namespace mid-stream":
        chunk.namespace_id = pf.other if first_ns != pf.other else pf.public
    elif kind == "other schedule id mid-stream":
        chunk.schedule_id = "another-schedule"
    elif kind == "other fingerprint mid-stream":
        chunk.fingerprint = data.draw(st.binary(min_size=1, max_size=40).filter(lambda b: b != FP))
    elif kind == "other depth mid-stream":
        chunk.depth = data.draw(st.integers(2, 2**32 - 1))
    else:
        raise AssertionError(f"no such defect {kind!r}")


@pytest.mark.parametrize("kind", list(SCHEDULE_DEFECTS), ids=lambda kind: kind or "no defect")
@settings(FUZZ, max_examples=max(5, FUZZ.max_examples // 10))
@given(data=st.data())
@pytest.mark.slow
def test_schedule_streams_with_one_defect(fuzzed, pf, kind, data):
    ns = data.draw(st.sampled_from([pf.public, pf.protected]))
    schedule_id = pf.schedule_id("s")
    previous = [7, BIG_ID, 5001] if data.draw(st.booleans(), label="pushed before") else None
    if previous is not None:
        pf.client.schedule(ns, FP, 1, schedule_id, previous)
    mid_stream = kind is not None and kind.endswith("mid-stream")
    n_chunks = 0 if kind == "empty stream" else data.draw(st.integers(2 if mid_stream else 1, 4))
    at = 0 if kind in FIRST_CHUNK_DEFECTS else data.draw(st.integers(1 if mid_stream else 0, max(0, n_chunks - 1)))
    head = {"namespace_id": ns, "fingerprint": FP, "depth": 1, "schedule_id": schedule_id}
    ids_of = st.one_of(st.integers(0, STORED - 1), st.sampled_from([BIG_ID, *UNSTORED]))
    chunks, order, variants = [], [], []
    for k in range(n_chunks):
        ids = data.draw(st.lists(ids_of, max_size=30))
        vars_ = data.draw(st.one_of(st.none(), st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids))))
        chunk = pb.ScheduleChunk()
        for name, value in head.items():  # later chunks leave the head unset or repeat it
            if k == 0 or data.draw(st.booleans()):
                setattr(chunk, name, value)
        if data.draw(st.booleans()):
            chunk.packed_sample_ids = np.array(ids, "<u8").tobytes()
        else:
            chunk.sample_ids.extend(ids)
        if vars_ is not None:
            if data.draw(st.booleans()):
                chunk.packed_variants = np.array(vars_, "<u2").tobytes()
            else:
                chunk.variants.extend(vars_)
        if k == at and kind is not None:
            _chunk_defect(data, kind, chunk, ids, pf, ns)
        chunks.append(chunk)
        order += ids
        variants += vars_ or [0] * len(ids)
    code, reply = push(pf.channel, chunks)
    documented = SCHEDULE_DEFECTS[kind]
    assert code == documented, f"{kind or 'no defect'}: {code.name}, documented {documented.name}"
    if code == OK:
        assert (reply.schedule_id, reply.length, reply.replaced) == (schedule_id, len(order), previous is not None)
    elif previous is not None:  # a failed push changes nothing
        order, variants = previous, [0] * len(previous)
    fetch_code, got, _ = fetch_status(pf, ns, schedule_id)
    if code != OK and previous is None:
        assert fetch_code == grpc.StatusCode.NOT_FOUND, "a failed push left a schedule behind"
    else:
        assert fetch_code == OK
        check_entries(got, order, variants)
    settle(pf)
    count(f"schedule defect: {kind or 'none'}")


@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_fetch_requests(fuzzed, pf, data):
    ns = data.draw(st.sampled_from([pf.public, pf.protected]))
    schedule_id = pf.schedule_id("f")
    ids_of = st.one_of(st.integers(0, STORED - 1), st.sampled_from([BIG_ID, *UNSTORED]))
    order = data.draw(st.lists(ids_of, max_size=120))
    order *= data.draw(st.sampled_from([1, 40]), label="repeats")  # up to 5 MB: more than gRPC sends ahead
    pf.client.schedule(ns, FP, 1, schedule_id, order)
    target = data.draw(st.one_of(st.just("schedule"), st.sampled_from([  # half of the examples fetch the schedule
        "unknown schedule", "unknown namespace", "other namespace", "protected namespace by its small id"])))
    fetch_ns, fetch_id, expected = {
        "schedule": (ns, schedule_id, OK),
        "unknown schedule": (ns, schedule_id + "-x", grpc.StatusCode.NOT_FOUND),
        "unknown namespace": (data.draw(st.sampled_from([UNKNOWN_SMALL_ID, 2**64 - 1])), schedule_id,
                              grpc.StatusCode.NOT_FOUND),
        "other namespace": (pf.other, schedule_id, grpc.StatusCode.NOT_FOUND),
        "protected namespace by its small id": (pf.protected_id, schedule_id, grpc.StatusCode.PERMISSION_DENIED),
    }[target]
    past_end = st.one_of(st.integers(len(order) + 1, 2**64 - 1), st.sampled_from([len(order) + 1, 2**63, 2**64 - 1]))
    start = data.draw(st.one_of(st.integers(0, len(order)), st.just(0), past_end), label="start")
    shared_memory = data.draw(st.booleans(), label="shared_memory")
    ring_bytes = data.draw(st.one_of(st.sampled_from([0, 1, RING_MIN - 1, 1 << 20, 2**64 - 1]), u64),
                           label="ring_bytes")
    frame_bytes = data.draw(st.one_of(st.sampled_from([0, 1, 4096, 2**64 - 1]), st.integers(0, 1 << 22)),
                            label="max_frame_bytes")
    cancel_after = data.draw(st.one_of(st.none(), st.integers(0, 3)), label="cancel after batches")
    if expected == OK and start > len(order):
        expected = grpc.StatusCode.INVALID_ARGUMENT  # start past the end
    variants = [0] * len(order)
    # Any ring_bytes works: the ring is at least 64 KiB, and BIG_ID (100 KiB) then travels in its frame (actcache.shm).
    kwargs = {"max_frame_bytes": frame_bytes, "shared_memory": shared_memory, "ring_bytes": ring_bytes}
    got, planes, position, code, stopped = [], set(), start, OK, False
    batches = pf.client.fetch_batches(fetch_ns, fetch_id, start, **kwargs)
    try:
        for i, batch in enumerate(batches):
            if i == cancel_after:
                stopped = True
                break
            planes.add(batch.data_plane)
            got.extend((pos, sid, var, None if v is None else bytes(v)) for pos, sid, var, v in batch)
            position += len(batch)
    except ActCacheError as exc:
        code = code_of(exc)
    finally:
        batches.close()  # cancels the call if it is still streaming
    cancelled = stopped and position < len(order)
    if cancelled:  # resume where the consumer stopped, on the bytes plane
        code, rest, _ = fetch_status(pf, fetch_ns, fetch_id, start=position, max_frame_bytes=frame_bytes)
        if code == grpc.StatusCode.NOT_FOUND:
            # The daemon had sent the last frame before the cancel (gRPC sends ahead of the consumer): the
            # schedule was served to its end, which retires it (ScheduleNotFound). What came is the model's.
            assert not rest
            check_entries(got, order[: start + len(got)], variants, start)
            settle(pf)
            count("fetch-requests cancelled after the last frame was sent")
            return
        got += rest
    assert code == expected, f"Fetch of {target} from {start} answered {code.name}, documented {expected.name}"
    assert planes <= {"shared_memory" if shared_memory else "bytes"}
    if code == OK:
        check_entries(got, order, variants, start)
    else:  # every documented error of Fetch comes before its first entry
        assert got == []
    settle(pf)
    count("fetch-requests" + (" cancelled+resumed" if cancelled else ""))


@pytest.mark.parametrize("ring_bytes", [1, RING_MIN - 1, 2**64 - 1])
def test_absurd_ring_sizes_still_serve_every_entry(fuzzed, pf, ring_bytes):
    """ring_bytes is raised to 64 KiB or capped at 4 GiB (actcache.shm); an entry larger than the ring (BIG_ID)
    travels in its frame's payload, so the stream neither ends early nor stalls."""
    order = [1, BIG_ID, 5000, 2] * 40
    schedule_id = pf.schedule_id("ring")
    pf.client.schedule(pf.public, FP, 1, schedule_id, order)
    got, planes = fetched(pf.client, pf.public, schedule_id, shared_memory=True, ring_bytes=ring_bytes,
                          max_frame_bytes=4096)
    assert planes == {"shared_memory"}
    check_entries(got, order, [0] * len(order))
    settle(pf)
    count("absurd-rings")


@pytest.mark.slow
def test_giant_schedules_beyond_the_limits(fuzzed, pf):
    """A chunk larger than the daemon's message limit (OpenReply.max_message_bytes) is RESOURCE_EXHAUSTED, refused
    by gRPC before the daemon holds it; 4 M ids in chunks are within the limits and served from any start; more than
    MAX_SCHEDULES_PER_NAMESPACE schedules in a namespace release the oldest unfetched ones. (The length limit,
    MAX_SCHEDULE_LENGTH = 2**31 ids, is 16 GiB of ids: too much to send here.)"""
    limit = pf.client.open("pf-a").max_message_bytes
    too_big = pb.ScheduleChunk(namespace_id=pf.public, fingerprint=FP, depth=1, schedule_id="giant-chunk",
                               packed_sample_ids=bytes(limit - limit % 8 + 8))
    assert push(pf.channel, [too_big])[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    del too_big
    assert fetch_status(pf, pf.public, "giant-chunk")[0] == grpc.StatusCode.NOT_FOUND

    n = 4 << 20
    order = np.arange(n, dtype=np.uint64) % (STORED + 5)  # ids 100..104: misses
    assert pf.client.schedule(pf.public, FP, 1, "giant", order, chunk_ids=1 << 18).length == n
    got, planes = fetched(pf.client, pf.public, "giant", start=n - 300, shared_memory=True)
    assert planes == {"shared_memory"}
    check_entries(got, order, np.zeros(n, np.uint16), n - 300)
    assert fetch_status(pf, pf.public, "giant")[0] == grpc.StatusCode.NOT_FOUND  # served to its end

    many = pf.client.open("pf-many").namespace_id
    total = MAX_SCHEDULES_PER_NAMESPACE + 6
    for k in range(total):
        pf.client.schedule(many, FP, 1, f"m{k}", [k])
    live = sorted(s.schedule_id for s in pf.client.stats().schedules if s.namespace == "pf-many")
    assert live == sorted(f"m{k}" for k in range(6, total))
    for k in range(total):
        code, got, _ = fetch_status(pf, many, f"m{k}")
        assert (code, [sid for _, sid, _, _ in got]) == ((grpc.StatusCode.NOT_FOUND, []) if k < 6 else (OK, [k]))
    settle(pf)
    count("giant-schedules")


def test_schedule_upload_cancelled_midway_changes_nothing(fuzzed, pf):
    """gRPC ends a request stream alike for a client that half-closed and one that cancelled, yet the daemon
    must not push what it received of a cancelled upload. In each round, uploads stall after two chunks and are
    cancelled: a schedule pushed before under the same id stays intact, a new id stays absent, and while the
    uploads are stalled the daemon serves others."""
    schedule = pf.channel.stream_unary(method("Schedule"), request_serializer=pb.ScheduleChunk.SerializeToString,
                                       response_deserializer=pb.ScheduleReply.FromString)

    def stalled(schedule_id: str, sent: threading.Event, resume: threading.Event):
        yield pb.ScheduleChunk(namespace_id=pf.public, fingerprint=FP, depth=1, schedule_id=schedule_id,
                               sample_ids=range(40, 60))
        yield pb.ScheduleChunk(sample_ids=range(60, 80))
        sent.set()  # asked for a third chunk: both are on their way
        resume.wait()
        yield pb.ScheduleChunk(sample_ids=range(80, 90))

    for r in range(10):
        kept, fresh = f"kept{r}", f"fresh{r}"
        pf.client.schedule(pf.public, FP, 1, kept, [1, BIG_ID, 5000])
        uploads = []
        for schedule_id in (kept, fresh):
            sent, resume = threading.Event(), threading.Event()
            uploads.append((schedule.future(stalled(schedule_id, sent, resume), timeout=60), resume))
            assert sent.wait(30)
        round_trip(pf)
        for future, resume in uploads:
            future.cancel()
            resume.set()
            with pytest.raises(grpc.FutureCancelledError):
                future.result()
        round_trip(pf)
        code, got, _ = fetch_status(pf, pf.public, kept)
        assert code == OK, f"round {r}: the schedule pushed before the cancelled upload is gone ({code.name})"
        check_entries(got, [1, BIG_ID, 5000], [0, 0, 0])
        code = fetch_status(pf, pf.public, fresh)[0]
        assert code == grpc.StatusCode.NOT_FOUND, f"round {r}: a cancelled upload was pushed ({code.name})"
    settle(pf)
    count("cancelled-uploads")


@pytest.mark.parametrize("plane", ["bytes", "shared_memory"])
@pytest.mark.slow
def test_fetch_cancelled_mid_stream_frees_its_memory_and_resumes(fuzzed, pf, plane):
    name = f"pf-cancel-{plane}"
    ns = pf.client.open(name).namespace_id
    put_range(pf.client, ns, range(STORED), fingerprint=FP)
    # 10 MB in 4 KiB frames: more than gRPC sends ahead of a consumer, and than a 64 KiB ring holds
    order = np.arange(STORED, dtype=np.uint64).repeat(100)
    pf.client.schedule(ns, FP, 1, "c", order)
    kwargs = {"max_frame_bytes": 4096, "shared_memory": plane == "shared_memory", "ring_bytes": RING_MIN}
    batches = pf.client.fetch_batches(ns, "c", **kwargs)
    got = []
    for batch in batches:
        assert batch.data_plane == plane
        got.extend((pos, sid, var, None if v is None else bytes(v)) for pos, sid, var, v in batch)
        if len(got) >= 20:
            break
    batches.close()  # cancels the call mid-stream
    wait_until(lambda: next(p for p in pf.client.stats().prefetch if p.namespace == name).buffered_bytes == 0,
               what="the cancelled stream's read-ahead memory freed")
    wait_until(lambda: segments(pf.shm) == [], what="the cancelled stream's segment removed")
    rest, planes = fetched(pf.client, ns, "c", start=len(got), **kwargs)
    assert planes == {plane}
    check_entries(got + rest, order, np.zeros(len(order), np.uint16))
    settle(pf)
    count("cancelled-fetches")


@pytest.fixture(autouse=True)
def _alive_after_each_test(request, fuzzed):
    yield
    check_alive(fuzzed, request.node.name)
