"""Put through a shared-memory segment (PutShared), against a real daemon."""

import re

import grpc
import numpy as np
import pytest
import torch

from actcache._proto import actcache_pb2 as pb
from actcache.codec import DType, TensorSpec, decode_entry, pack_layout
from actcache.errors import InvalidRequest
from actcache.rpc import encode_frame, method
from actcache.rpc_client import RpcClient
from actcache.testing import run_daemon, wait_until
from actcache_client.transport._tensors import encode_samples, sample_columns
from tests.integration.conftest import SHM_FP as FP
from tests.integration.conftest import segments


def entries(n: int, floats: int = 4096, seed: int = 0) -> list[bytes]:
    state = torch.from_numpy(np.random.default_rng(seed).random((n, floats), dtype=np.float32))
    return [bytes(e) for e in encode_samples(state)]


def shared_put_call(channel: grpc.Channel):
    return channel.stream_stream(method("PutShared"), response_deserializer=pb.PutReply.FromString)


def frame(header: pb.PutHeader, payload: bytes = b"") -> bytes:
    return encode_frame(header.SerializeToString(), [payload] if payload else [])


def test_puts_go_through_one_segment_whose_name_goes_once_mapped(shm_dir):
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client(shared_puts=True) as client:
        ns = client.open("put").namespace_id
        values = entries(192)
        for start in range(0, 192, 64):
            reply = client.put(ns, FP, 1, [(i, 0, values[i]) for i in range(start, start + 64)], encoding="raw")
            assert reply.entries == 64
            assert segments(shm_dir) == []  # mapped by the client, then unlinked by the daemon
        assert client.put_plane_detail == ""
        assert client.stats().put_segments_total == 1  # one stream for every put
        assert [bytes(v) for v in client.get(ns, FP, 1, list(range(192)))] == values


def test_columns_are_encoded_by_the_daemon_as_the_client_would(shm_dir):
    """A state of two tensors: the entries stored are byte for byte those encode_samples makes, variants kept."""
    state = (torch.randn(48, 8, 4, 4), torch.arange(48 * 3).reshape(48, 3))
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client(shared_puts=True) as client:
        ns = client.open("cols").namespace_id
        specs, columns = sample_columns(state)
        parts = [[c[:20] for c in columns], [c[20:] for c in columns]]  # two runs of samples, as a group sends them
        reply = client.put_columns(ns, FP, 2, list(range(48)), [3] * 48, specs, parts, encoding="raw")
        assert reply is not None and reply.entries == 48
        got = client.get(ns, FP, 2, list(range(48)), [3] * 48)
        assert [bytes(v) for v in got] == [bytes(e) for e in encode_samples(state)]
        assert client.get(ns, FP, 2, [0], [0]) == [None]  # stored under variant 3 only
        with pytest.raises(InvalidRequest, match="not one uint8 row"):  # 48 rows for 47 samples
            client.put_columns(ns, FP, 2, list(range(47)), None, specs, [columns])
        lz4 = client.put_columns(ns, FP, 3, list(range(48)), None, specs, [columns], encoding="lz4")
        assert lz4 is not None and lz4.entries == 48
        decoded = [decode_entry(v)[1] for v in client.get(ns, FP, 3, list(range(48)))]
        assert [bytes(d) for d in decoded] == [bytes(decode_entry(e)[1]) for e in encode_samples(state)]


def test_a_put_larger_than_the_segment_gets_a_larger_one(shm_dir):
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client(shared_puts=True) as client:
        ns = client.open("big").namespace_id
        small, large = entries(16), entries(640, seed=1)  # 256 KiB, then 10 MiB: over the first 8 MiB segment
        client.put(ns, FP, 1, list(zip(range(16), [0] * 16, small)))
        client.put(ns, FP, 1, list(zip(range(16, 656), [0] * 640, large)))
        assert client.stats().put_segments_total == 2
        assert [bytes(v) for v in client.get(ns, FP, 1, list(range(656)))] == small + large


def test_frames_that_name_bytes_outside_the_segment_are_refused(shm_dir):
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client() as client:
        ns = client.open("bad").namespace_id
        wrong = {
            "past the end": pb.PutHeader(namespace_id=ns, fingerprint=FP, depth=1, sample_ids=[1], lengths=[2 << 20]),
            "columns past the end": pb.PutHeader(  # 3 samples of 1 MiB
                namespace_id=ns, fingerprint=FP, depth=1, layout=pack_layout([TensorSpec(DType.float32, (1 << 18,))]),
                packed_sample_ids=np.arange(3, dtype="<u8").tobytes()),
            "no layout": pb.PutHeader(namespace_id=ns, fingerprint=FP, depth=1, layout=bytes(64),
                                      packed_sample_ids=np.arange(3, dtype="<u8").tobytes()),
        }
        with grpc.insecure_channel(daemon.target) as channel:
            for what, header in wrong.items():
                replies = shared_put_call(channel)(iter([frame(pb.PutHeader(segment_bytes=1 << 20)), frame(header)]))
                assert next(replies).segment, what
                with pytest.raises(grpc.RpcError) as caught:
                    next(replies)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            replies = shared_put_call(channel)(iter([
                frame(pb.PutHeader(segment_bytes=1 << 20)),
                frame(pb.PutHeader(namespace_id=ns, fingerprint=FP, depth=1, sample_ids=[1], lengths=[4]), b"data")]))
            next(replies)
            with pytest.raises(grpc.RpcError, match="carries 4 bytes itself"):
                next(replies)
            with pytest.raises(grpc.RpcError) as caught:
                next(shared_put_call(channel)(iter([frame(pb.PutHeader(segment_bytes=0))])))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.get(ns, FP, 1, [1]) == [None]


def test_a_client_gone_before_mapping_leaves_no_segment(shm_dir):
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, grpc.insecure_channel(daemon.target) as channel:
        requests: list = [frame(pb.PutHeader(segment_bytes=1 << 20))]
        replies = shared_put_call(channel)(iter(requests))
        assert re.search(r"/actcache-\d+-", next(replies).segment)
        replies.cancel()
        wait_until(lambda: segments(shm_dir) == [], timeout=10, what="the unmapped segment removed")


def test_over_tcp_puts_travel_in_messages(shm_dir):
    env = {"ACTCACHE_SHM_DIR": str(shm_dir), "ACTCACHE_TOKEN": "t0ken"}
    with run_daemon("--listen", "127.0.0.1:0", env=env) as daemon:
        port = re.search(r"\(port (\d+)\)", daemon.log_path.read_text()).group(1)
        with RpcClient(f"127.0.0.1:{port}", token="t0ken", shared_puts=True) as client:
            ns = client.open("tcp").namespace_id
            values = entries(8)
            assert client.put(ns, FP, 1, list(zip(range(8), [0] * 8, values))).entries == 8
            assert "Unix socket" in client.put_plane_detail
            specs, columns = sample_columns(torch.zeros(8, 4))
            assert client.put_columns(ns, FP, 1, list(range(8)), None, specs, [columns]) is None
            assert client.stats().put_segments_total == 0
            assert [bytes(v) for v in client.get(ns, FP, 1, list(range(8)))] == values


def test_a_put_that_fails_unexpectedly_is_dropped_and_the_writer_goes_on():
    """A bug in one put (here its encoder raising TypeError) warns and drops it; the puts after it are stored
    and close() returns, even with more puts queued than the queue holds."""
    import actcache_client as ac

    with run_daemon() as daemon:
        conn = ac.connect(daemon.socket, namespace="bug", put_queue=2)
        values = entries(4)

        def broken() -> list:
            raise TypeError("a bug")

        with pytest.warns(ac.CacheFallbackWarning, match="failed unexpectedly .*TypeError: a bug"):
            for _ in range(3):
                conn.store(FP, 1, [0], [0], broken)
            conn.flush(timeout_s=10)
            conn.surface()
        conn.store(FP, 1, [1, 2], [0, 0], lambda: values[1:3])
        conn.flush(timeout_s=10)
        assert conn.stats.puts_dropped >= 1 and conn.stats.puts == 2
        conn.close()
        with daemon.client() as client:
            ns = client.open("bug").namespace_id
            assert [bytes(v) for v in client.get(ns, FP, 1, [1, 2])] == values[1:3]


def test_batches_of_columns_are_put_together_and_the_rest_after_a_while(monkeypatch):
    """Puts of one fingerprint and depth are gathered up to 4 MiB: six batches of 1 MiB are two puts, the
    second sent once no batch came for a while (an epoch's end) without a flush(); every entry is stored as
    encode_samples encodes it."""
    import actcache_client as ac

    sent = []
    put_columns = RpcClient.put_columns
    monkeypatch.setattr(RpcClient, "put_columns",
                        lambda self, *a, **k: sent.append(len(a[3])) or put_columns(self, *a, **k))
    states = [torch.randn(64, 4096, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    with run_daemon() as daemon:
        conn = ac.connect(daemon.socket, namespace="group")
        for i, state in enumerate(states):
            ids = list(range(64 * i, 64 * (i + 1)))
            conn.store(FP, 1, ids, [0] * 64, lambda s=state: encode_samples(s), encoding=lambda _: "raw",
                       columns=lambda s=state: sample_columns(s), nbytes=state.numel() * 4)
        wait_until(lambda: sent == [256, 128], timeout=10, what="4 MiB, then the 2 MiB left, unflushed")
        conn.flush(timeout_s=30)
        with daemon.client() as client:
            ns = client.open("group").namespace_id
            got = client.get(ns, FP, 1, list(range(64 * 6)))
        assert [bytes(v) for v in got] == [bytes(e) for s in states for e in encode_samples(s)]
        conn.close()


def test_an_idle_writer_waits_long_yet_puts_a_new_group_once_it_lingers(monkeypatch):
    """An idle connection's writer thread wakes rarely (a process may hold many connections), yet the group a
    store starts is put once no batch came for a while, not when the writer next wakes."""
    import actcache_client as ac
    from actcache_client.transport import _connection

    monkeypatch.setattr(_connection, "_PUT_STREAM_IDLE_S", 600.0)  # the idle writer's wait
    state = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    with run_daemon() as daemon:
        conn = ac.connect(daemon.socket, namespace="linger")
        conn.store(FP, 1, list(range(64)), [0] * 64, lambda: encode_samples(state), encoding=lambda _: "raw",
                   columns=lambda: sample_columns(state), nbytes=state.numel() * 4)
        wait_until(lambda: conn.stats.puts == 64, timeout=10, what="the lone group put, unflushed")
        conn.close()
