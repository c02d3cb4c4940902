"""The real daemon process over its Unix socket, with a real LMDB in a temp dir."""

import json
import multiprocessing
import os
import re
import stat
import subprocess
import sys
from concurrent import futures

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actcache import __version__, rpc
from actcache._proto import actcache_pb2 as pb
from actcache.codec import DType, TensorSpec, decode_entry, encode_entry
from actcache.errors import (
    BudgetExceeded,
    EntryCorrupt,
    InvalidRequest,
    NamespaceNotFound,
    Unauthenticated,
    VersionMismatch,
    error_from_status,
)
from actcache.rpc import SERVICE, encode_frame, method
from actcache.rpc_client import RpcClient
from actcache.testing import run_daemon
from tests.integration.conftest import MARKER, MARKER_SPEC, flip_marker_byte

FP = bytes(range(16))
NUMPY = {DType.float32: np.float32, DType.float16: np.float16, DType.bfloat16: np.uint16, DType.int64: np.int64,
         DType.int32: np.int32, DType.uint8: np.uint8, DType.bool: np.bool_}


def make_entry(seed: int, specs) -> tuple[bytes, list[bytes]]:
    rng = np.random.default_rng(seed)
    raws = []
    for spec in specs:
        data = rng.integers(0, 256, spec.nbytes, dtype=np.uint8)
        if spec.dtype == DType.bool:
            data %= 2
        raws.append(data.tobytes())
    return encode_entry(specs, raws), raws


def tensors_of(value) -> list[bytes]:
    header, raw = decode_entry(value)
    return [bytes(raw[o : o + s.nbytes]) for s, o in zip(header.specs, header.offsets)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(
        st.builds(TensorSpec, st.sampled_from(list(DType)), st.lists(st.integers(1, 9), max_size=4).map(tuple)),
        min_size=1, max_size=3,
    ),
    seed=st.integers(0, 2**31),
    sample_id=st.integers(0, 2**64 - 1),
    variant=st.integers(0, 2**16 - 1),
)
def test_round_trip_through_daemon_is_bit_exact(client, specs, seed, sample_id, variant):
    ns = client.open("roundtrip").namespace_id
    value, raws = make_entry(seed, specs)
    client.put(ns, FP, 3, [(sample_id, variant, value)])
    [got] = client.get(ns, FP, 3, [sample_id], [variant])
    assert tensors_of(got) == raws


def test_many_entries_span_frames_and_misses_are_answers(client):
    ns = client.open("frames").namespace_id
    spec = [TensorSpec(DType.float32, (64, 32, 32))]  # 256 KiB each: 60 entries span several frames
    values = {i: make_entry(i, spec)[0] for i in range(0, 120, 2)}
    client.put(ns, FP, 1, list((i, 0, v) for i, v in values.items()), frame_bytes=3 << 20)
    got = client.get(ns, FP, 1, list(range(120)))
    assert [g is not None for g in got] == [i % 2 == 0 for i in range(120)]
    assert all(bytes(got[i]) == values[i] for i in values)


def _writer(target: str, worker: int, count: int) -> None:
    with RpcClient(target) as client:
        ns = client.open("concurrent").namespace_id
        spec = [TensorSpec(DType.int64, (256,))]
        for start in range(0, count, 25):
            items = []
            for i in range(start, start + 25):
                payload = np.full(256, worker * 1_000_000 + i, np.int64)
                items.append((worker * 100_000 + i, 0, encode_entry(spec, [payload])))
            client.put(ns, FP, 2, items)


@pytest.mark.slow
def test_four_processes_write_concurrently_without_loss_or_mixup(daemon, client):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(daemon.target, w, 200)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    ns = client.open("concurrent").namespace_id
    for w in range(4):
        ids = [w * 100_000 + i for i in range(200)]
        for i, value in zip(range(200), client.get(ns, FP, 2, ids)):
            assert value is not None, f"worker {w} entry {i} lost"
            assert np.frombuffer(tensors_of(value)[0], np.int64)[0] == w * 1_000_000 + i
    group = [g for g in client.stats().groups if g.namespace == "concurrent"]
    assert group[0].entries == 800


def test_bad_input_gets_precise_status(daemon, client):
    ns = client.open("errors").namespace_id
    good, _ = make_entry(0, [TensorSpec(DType.float32, (4,))])
    with pytest.raises(NamespaceNotFound, match="namespace id 999"):
        client.get(999, FP, 0, [1])
    with pytest.raises(NamespaceNotFound, match="does not exist"):
        client.open("never-made", create=False)
    # Raw calls below bypass the client's own checks, as a foreign client would.
    with pytest.raises(grpc.RpcError) as info:
        next(client._call("Get")(pb.GetRequest(namespace_id=ns, fingerprint=b"12345678", sample_ids=[1]), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "fingerprint must be 16 bytes, got 8 bytes"
    bad_dtype = bytearray(good)
    bad_dtype[28] = 99  # dtype code of tensor 0
    with pytest.raises(InvalidRequest, match="unknown dtype code 99"):
        client.put(ns, FP, 0, [(1, 0, bytes(bad_dtype))])
    with pytest.raises(InvalidRequest, match="entry is .* bytes but its header says"):
        client.put(ns, FP, 0, [(1, 0, good + b"extra")])
    with pytest.raises(InvalidRequest, match="depth 70000 is out of range"):
        client.put(ns, FP, 70000, [(1, 0, good)])
    header = pb.PutHeader(namespace_id=ns, fingerprint=FP, depth=0, sample_ids=[1, 2], lengths=[len(good), 5])
    for frame, message in [
        (encode_frame(header.SerializeToString(), [good]),
         f"lists {len(good) + 5} payload bytes but the payload has {len(good)}"),
        (b"\x1a\x03abc", "frame has unexpected field 3"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            client._call("Put")(iter([frame]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details()
    assert client.get(ns, FP, 0, [1, 2]) == [None, None]  # nothing half-written
    assert client.stats().server_version  # the daemon is still serving


def test_a_put_says_how_its_entries_are_stored(client):
    ns = client.open("encodings").namespace_id
    sparse = np.zeros(8192, np.float32)
    sparse[::16] = 1.0  # compresses well
    entry = encode_entry([TensorSpec(DType.float32, (8192,))], [sparse.tobytes()])
    stored = {}
    for depth, encoding in enumerate(["raw", "lz4", "zstd:3", ""]):
        stored[encoding] = client.put(ns, FP, depth, [(1, 0, entry)], encoding=encoding).stored_bytes
        assert tensors_of(client.get(ns, FP, depth, [1])[0]) == [sparse.tobytes()]
    assert stored["raw"] == len(entry)
    assert stored["lz4"] < len(entry) / 4 and stored["zstd:3"] < len(entry) / 4 and stored["lz4"] != stored["zstd:3"]
    assert stored[""] == stored["lz4"]  # "": the daemon's --encoding (auto: lz4 where it saves 30%)
    for bad, message in [("zstd:99", "zstd level must be -7..22 and not 0, got 99"),
                         ("brotli", "unknown encoding 'brotli'; use auto, raw, lz4, zstd or zstd:LEVEL")]:
        with pytest.raises(InvalidRequest, match=f"PutHeader.encoding: {message}"):
            client.put(ns, FP, 9, [(1, 0, entry)], encoding=bad)
    assert client.get(ns, FP, 9, [1]) == [None]


def test_socket_is_private_and_daemon_has_no_torch(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    with open(f"/proc/{daemon.pid}/maps") as f:
        assert "libtorch" not in f.read()


def test_open_exchanges_versions_with_a_current_client(client):
    reply = client.open("versions")
    assert (reply.server_version, reply.protocol_version) == (__version__, rpc.PROTOCOL_VERSION)


def test_a_client_of_another_protocol_gets_one_clear_error(daemon, monkeypatch):
    monkeypatch.setattr(rpc, "PROTOCOL_VERSION", rpc.PROTOCOL_VERSION + 1)
    with daemon.client() as c, pytest.raises(VersionMismatch) as info:
        c.open("newer-client")
    message = str(info.value)
    for part in (f"client {__version__} (wire protocol {rpc.PROTOCOL_VERSION})",
                 f"node daemon {__version__} (wire protocol {rpc.PROTOCOL_VERSION - 1})",
                 "restart the node daemon", "`actcache stop`", "connect()", "FAILED_PRECONDITION"):
        assert part in message
    monkeypatch.undo()
    with daemon.client() as c:  # the daemon serves current clients on
        assert c.open("newer-client").namespace_id


def test_a_strict_connection_raises_the_mismatch_and_a_lenient_one_recomputes(daemon, monkeypatch):
    import actcache_client as ac

    monkeypatch.setattr(rpc, "PROTOCOL_VERSION", rpc.PROTOCOL_VERSION + 1)
    with ac.connect(daemon.socket, namespace="strict-versions", strict=True) as conn:
        with pytest.raises(VersionMismatch, match="restart the node daemon"):
            conn.contains(FP, 1, [1], 0)
    with ac.connect(daemon.socket, namespace="lenient-versions") as conn:
        with pytest.warns(ac.CacheFallbackWarning, match="wire protocol .*restart the node daemon"):
            assert conn.contains(FP, 1, [1], 0) is None


@pytest.mark.parametrize("protocol", [0, rpc.PROTOCOL_VERSION + 1], ids=["older-client", "newer-client"])
def test_the_daemon_rejects_an_open_of_another_protocol(daemon, protocol):
    with grpc.insecure_channel(daemon.target) as channel:
        call = channel.unary_unary(method("Open"), request_serializer=pb.OpenRequest.SerializeToString,
                                   response_deserializer=pb.OpenReply.FromString)
        with pytest.raises(grpc.RpcError) as info:
            call(pb.OpenRequest(name="foreign", create=True, protocol_version=protocol,
                                client_version="9.9.9" if protocol else ""), timeout=10)
    exc = info.value
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
    name = dict(exc.trailing_metadata())["actcache-error"]
    error = error_from_status(exc.code(), exc.details(), name)
    assert type(error) is VersionMismatch
    side = "unknown (wire protocol unknown: older than the version check)" if protocol == 0 else \
        f"9.9.9 (wire protocol {protocol})"
    assert f"client {side}" in str(error) and f"node daemon {__version__} (wire protocol {rpc.PROTOCOL_VERSION})" \
        in str(error)


def test_a_daemon_older_than_the_version_exchange_is_a_mismatch(tmp_path):
    """A daemon that leaves OpenReply.protocol_version unset (it predates the field)."""
    def open_(request, context):
        return pb.OpenReply(namespace_id=1, server_version="0.0.9")

    server = grpc.server(futures.ThreadPoolExecutor(1))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Open": grpc.unary_unary_rpc_method_handler(open_, pb.OpenRequest.FromString, pb.OpenReply.SerializeToString),
    })])
    target = f"unix:{tmp_path / 'old.sock'}"
    server.add_insecure_port(target)
    server.start()
    try:
        with RpcClient(target, timeout_s=10) as c, pytest.raises(VersionMismatch) as info:
            c.open("any")
    finally:
        server.stop(None)
    assert "node daemon 0.0.9 (wire protocol unknown: older than the version check)" in str(info.value)
    assert "`actcache stop`" in str(info.value)


@pytest.mark.slow
def test_entries_survive_restart_and_corruption_is_data_loss(tmp_path):
    spec = MARKER_SPEC
    with run_daemon("--encoding", "raw", cache_dir=tmp_path / "c") as d:
        with d.client() as c:
            ns = c.open("survive").namespace_id
            c.put(ns, FP, 5, [(1, 0, encode_entry(spec, [MARKER])), (2, 0, make_entry(2, spec)[0])])
        d.stop()
        flip_marker_byte(tmp_path / "c")
        d.start()
        with d.client() as c:
            assert tensors_of(c.get(ns, FP, 5, [2])[0]) == make_entry(2, spec)[1]
            with pytest.raises(EntryCorrupt, match=r"sample ids \[1\].*DATA_LOSS"):
                c.get(ns, FP, 5, [1, 2])
            assert [v is None for v in c.get(ns, FP, 5, [1, 2])] == [True, False]
            assert c.stats().corrupt_total == 1


@pytest.mark.slow
def test_budget_exhausted_then_drop_then_writes_succeed():
    spec = [TensorSpec(DType.uint8, (100_000,))]
    with run_daemon("--namespace-budget", "1MB", "--encoding", "raw") as d, d.client() as c:
        ns = c.open("tight").namespace_id
        c.put(ns, FP, 1, [(i, 0, make_entry(i, spec)[0]) for i in range(9)])
        with pytest.raises(BudgetExceeded, match="namespace 'tight' uses .* byte budget.*RESOURCE_EXHAUSTED"):
            c.put(ns, FP, 1, [(i, 0, make_entry(i, spec)[0]) for i in range(9, 12)])
        assert c.get(ns, FP, 1, [0])[0] is not None
        assert c.drop(ns).entries == 9
        c.put(ns, FP, 1, [(i, 0, make_entry(i, spec)[0]) for i in range(9, 12)])


@pytest.mark.slow
def test_tcp_requires_a_token_and_checks_it(tmp_path):
    env = {**os.environ}
    env.pop("ACTCACHE_TOKEN", None)
    refused = subprocess.run(
        [sys.executable, "-m", "actcache", "serve", "--dir", str(tmp_path), "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, env=env, timeout=30,
    )
    assert refused.returncode == 2 and "without a token" in refused.stderr
    with run_daemon("--listen", "127.0.0.1:0", env={"ACTCACHE_TOKEN": "s3cret"}) as d:
        port = re.search(r"\(port (\d+)\)", d.log_path.read_text()).group(1)
        with RpcClient(f"127.0.0.1:{port}", token="wrong") as bad, pytest.raises(Unauthenticated):
            bad.open("x")
        with RpcClient(f"127.0.0.1:{port}", token="s3cret") as good:
            assert good.open("x").namespace_id >= 1


@pytest.mark.slow
def test_cli_stats_ls_drop(daemon, client):
    ns = client.open("cli").namespace_id
    client.put(ns, FP, 7, [(i, 0, make_entry(i, [TensorSpec(DType.int32, (10,))])[0]) for i in range(5)])

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "actcache", *args, "--socket", str(daemon.socket)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    rows = [r for r in json.loads(cli("ls", "--json")) if r["namespace"] == "cli"]
    assert rows == [{"namespace": "cli", "fingerprint": FP.hex(), "depth": 7, "entries": 5, "bytes": rows[0]["bytes"],
                     "last_write": rows[0]["last_write"], "last_read": None, "reclaimable": False, "live_schedules": 0}]
    assert rows[0]["last_write"] > 0
    assert "cli" in cli("stats") and "hit ratio" in cli("stats")
    assert int(json.loads(cli("stats", "--json"))["puts_total"]) >= 5
    assert json.loads(cli("drop", "cli", "--fingerprint", FP.hex(), "--depth", "7", "--json"))["entries"] == 5
    assert not [r for r in json.loads(cli("ls", "--json")) if r["namespace"] == "cli"]


def test_contains_answers_which_entries_are_stored_without_reading_them(client):
    ns = client.open("contains").namespace_id
    entry = encode_entry([TensorSpec(DType.uint8, (4,))], [b"abcd"])
    client.put(ns, FP, 2, [(1, 0, entry), (3, 0, entry), (3, 1, entry)])
    assert client.contains(ns, FP, 2, [0, 1, 2, 3]).tolist() == [False, True, False, True]
    assert client.contains(ns, FP, 2, [3, 3, 1], variants=[0, 1, 1]).tolist() == [True, True, False]
    assert client.contains(ns, FP, 1, [1]).tolist() == [False]  # another depth
    assert client.contains(ns, FP, 2, []).tolist() == []
    bad = pb.ContainsRequest(namespace_id=ns, fingerprint=FP, depth=2, packed_sample_ids=b"\x01" * 7)
    with pytest.raises(grpc.RpcError) as info:
        client._call("Contains")(bad, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "multiple of 8" in info.value.details()
    with pytest.raises(NamespaceNotFound):
        client.contains(999_999, FP, 2, [1])


def test_sigusr1_writes_every_thread_stack_to_the_log_and_the_daemon_goes_on(daemon, client):
    dump = daemon.thread_dump()
    assert "most recent call first" in dump and "in serve" in dump  # the main thread, waiting for a signal
    assert "_writer.py" in dump  # and the others: the store's writer thread
    ns = client.open("after-dump").namespace_id
    value, raws = make_entry(1, [TensorSpec(DType.float32, (2, 2))])
    client.put(ns, FP, 1, [(1, 0, value)])
    assert tensors_of(client.get(ns, FP, 1, [1])[0]) == raws
