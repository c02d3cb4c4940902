"""Fetch through the shared-memory data plane, against a real daemon."""

import os

import grpc
import numpy as np
import pytest

from actcache._proto import actcache_pb2 as pb
from actcache.codec import DType, TensorSpec, decode_entry, encode_entry
from actcache.rpc import decode_frame, method
from actcache.shm import ClientSegment
from actcache.testing import run_daemon
from tests.integration.conftest import (
    MARKER,
    MARKER_SPEC,
    fetched,
    flip_marker_byte,
    kill_9,
    put_range,
    segments,
    start_holder,
)
from tests.integration.conftest import SHM_FP as FP
from tests.integration.conftest import SMALL_RING as RING


@pytest.mark.slow
def test_shared_memory_equals_bytes_path_with_misses_in_place_and_reuses_the_ring(shm_dir):
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client() as client:
        ns = client.open("eq").namespace_id
        put_range(client, ns, range(0, 600, 2))  # odd ids are misses
        order = np.random.default_rng(3).permutation(600).astype(np.uint64)  # ~300 KiB of hits: 5 turns of the ring
        client.schedule(ns, FP, 1, "a", order)
        expected, planes = fetched(client, ns, "a")
        assert planes == {"bytes"}
        client.schedule(ns, FP, 1, "b", order)
        got, planes = [], set()
        for batch in client.fetch_batches(ns, "b", shared_memory=True, ring_bytes=RING, max_frame_bytes=8 << 10):
            planes.add(batch.data_plane)
            got.extend((pos, sid, var, None if v is None else bytes(v)) for pos, sid, var, v in batch)
        assert planes == {"shared_memory"}
        assert got == expected
        assert [g[3] is None for g in got] == [int(s) % 2 == 1 for s in order]
        assert segments(shm_dir) == []  # unlinked once mapped


@pytest.mark.slow
def test_a_slot_is_reused_only_after_its_release(shm_dir):
    """A raw call that releases nothing receives exactly what fits in the ring, in disjoint slots."""
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client() as client:
        ns = client.open("reuse").namespace_id
        put_range(client, ns, range(200))
        client.schedule(ns, FP, 1, "e", np.arange(200, dtype=np.uint64))
        expected = {pos: v for pos, _, _, v in fetched(client, ns, "e")[0]}
        capacity = RING // len(expected[0])  # all entries have one size: no wrap gap before the ring is full once
        client.schedule(ns, FP, 1, "r", np.arange(200, dtype=np.uint64))
        with grpc.insecure_channel(daemon.target) as channel:
            fetch = channel.unary_stream(method("Fetch"), request_serializer=pb.FetchRequest.SerializeToString)
            call = fetch(pb.FetchRequest(namespace_id=ns, schedule_id="r", shared_memory=True, ring_bytes=RING,
                                         max_frame_bytes=4 << 10))
            frames = iter(call)
            segment, held, position = None, [], 0
            while position < capacity:
                header = pb.EntriesHeader.FromString(bytes(decode_frame(next(frames))[0]))
                segment = segment or ClientSegment(header.segment)
                for i, (off, n) in enumerate(zip(header.offsets, header.lengths)):
                    held.append((header.start + i, off, n))
                position = header.start + len(header.lengths)
            assert position == capacity
            spans = sorted((off, off + n) for _, off, n in held)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no slot handed out twice
            assert all(bytes(segment.view[off : off + n]) == expected[pos] for pos, off, n in held)
            segment.release(position)  # now the rest comes, reusing the ring
            for frame in frames:
                header = pb.EntriesHeader.FromString(bytes(decode_frame(frame)[0]))
                for i, (off, n) in enumerate(zip(header.offsets, header.lengths)):
                    assert bytes(segment.view[off : off + n]) == expected[header.start + i]
                    held.append((header.start + i, off, n))
                segment.release(header.start + len(header.lengths))
            assert [p for p, _, _ in held] == list(range(200))
            assert len({off for _, off, _ in held}) < 200  # slots were reused


@pytest.mark.slow
def test_kill_9_of_a_client_holding_slots_then_a_new_client_works(shm_dir):
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client() as client:
        ns = client.open("kill").namespace_id
        put_range(client, ns, range(300))
        order = np.arange(300, dtype=np.uint64)
        client.schedule(ns, FP, 1, "k", order)
        kill_9(start_holder(daemon.target, ns, "k"))
        got, planes = fetched(client, ns, "k", shared_memory=True, ring_bytes=RING)
        assert planes == {"shared_memory"}
        assert [g[1] for g in got] == list(range(300)) and all(g[3] is not None for g in got)
        assert segments(shm_dir) == []


def test_bytes_fallback_when_shared_memory_is_unavailable(tmp_path):
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(tmp_path / "missing")}) as daemon, daemon.client() as client:
        ns = client.open("fb").namespace_id
        put_range(client, ns, range(10))
        client.schedule(ns, FP, 1, "f", np.arange(12, dtype=np.uint64))
        with grpc.insecure_channel(daemon.target) as channel:
            fetch = channel.unary_stream(method("Fetch"), request_serializer=pb.FetchRequest.SerializeToString)
            frame = next(iter(fetch(pb.FetchRequest(namespace_id=ns, schedule_id="f", shared_memory=True))))
        header = pb.EntriesHeader.FromString(bytes(decode_frame(frame)[0]))
        assert header.data_plane == "bytes" and "shared memory unavailable" in header.data_plane_detail
        client.schedule(ns, FP, 1, "g", np.arange(12, dtype=np.uint64))
        got, planes = fetched(client, ns, "g", shared_memory=True)
        assert planes == {"bytes"} and [g[3] is None for g in got] == [False] * 10 + [True] * 2


@pytest.mark.slow
def test_kill_9_of_the_daemon_leftovers_removed_at_restart_and_by_clean(shm_dir, tmp_path):
    from actcache.ops.clean import Action, CleanTarget, stale_shm_segments

    env = {"ACTCACHE_SHM_DIR": str(shm_dir)}
    with run_daemon(env=env, check_exit=False) as daemon:
        with daemon.client() as client:
            ns = client.open("crash").namespace_id
            put_range(client, ns, range(200))  # more than the ring holds: the stream cannot end unreleased
            client.schedule(ns, FP, 1, "c", np.arange(200, dtype=np.uint64))
        with grpc.insecure_channel(daemon.target) as channel:
            fetch = channel.unary_stream(method("Fetch"), request_serializer=pb.FetchRequest.SerializeToString)
            call = fetch(pb.FetchRequest(namespace_id=ns, schedule_id="c", shared_memory=True, ring_bytes=RING,
                                         max_frame_bytes=4 << 10))
            next(iter(call))  # a segment exists; this client never maps it
            dead = daemon.pid
            assert segments(shm_dir) and all(n.startswith(f"actcache-{dead}-") for n in segments(shm_dir))
            daemon.kill()
        daemon.start()
        assert segments(shm_dir) == []
        # `actcache clean` removes one of a dead pid too, and keeps the live daemon's.
        (shm_dir / f"actcache-{dead}-0123456789abcdef").write_bytes(b"x")
        (shm_dir / f"actcache-{daemon.pid}-0123456789abcdef").write_bytes(b"x")
        os.environ["ACTCACHE_SHM_DIR"] = str(shm_dir)
        try:
            findings = list(stale_shm_segments(CleanTarget(socket=None, dir=None, daemon_live=True, daemon_pid=daemon.pid)))
        finally:
            del os.environ["ACTCACHE_SHM_DIR"]
        assert {(f.action, f.path.rsplit("/", 1)[1].split("-")[1]) for f in findings} == {
            (Action.REMOVED, str(dead)), (Action.KEPT, str(daemon.pid))}
        assert segments(shm_dir) == [f"actcache-{daemon.pid}-0123456789abcdef"]


def test_a_tcp_client_asking_for_shared_memory_gets_bytes(shm_dir):
    import re

    env = {"ACTCACHE_SHM_DIR": str(shm_dir), "ACTCACHE_TOKEN": "t0ken"}
    with run_daemon("--listen", "127.0.0.1:0", env=env) as daemon:
        port = re.search(r"\(port (\d+)\)", daemon.log_path.read_text()).group(1)
        with daemon.client(token="t0ken") as client:
            ns = client.open("tcp").namespace_id
            put_range(client, ns, range(5))
            client.schedule(ns, FP, 1, "t", np.arange(6, dtype=np.uint64))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            fetch = channel.unary_stream(method("Fetch"), request_serializer=pb.FetchRequest.SerializeToString)
            request = pb.FetchRequest(namespace_id=ns, schedule_id="t", shared_memory=True)
            frames = list(fetch(request, metadata=[("authorization", "Bearer t0ken")]))
        header = pb.EntriesHeader.FromString(bytes(decode_frame(frames[0])[0]))
        assert header.data_plane == "bytes" and "not on this host's Unix socket" in header.data_plane_detail
        assert sum(len(pb.EntriesHeader.FromString(bytes(decode_frame(f)[0])).lengths) for f in frames) == 6
        assert len(decode_frame(frames[0])[1]) == sum(header.lengths) > 0
        assert segments(shm_dir) == []


def test_entries_larger_than_the_ring_travel_in_their_frame(shm_dir):
    """Small entries go through the ring and larger-than-ring ones inline; the stream never ends early."""
    rng = np.random.default_rng(5)
    tensors = {i: rng.standard_normal(40_000 if i % 3 == 0 else 1_000, dtype=np.float32) for i in range(30)}
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client() as client:
        ns = client.open("large").namespace_id
        client.put(ns, FP, 1, [(i, 0, encode_entry([TensorSpec(DType.float32, t.shape)], [t])) for i, t in tensors.items()])
        order = np.arange(30, dtype=np.uint64)[::-1].copy()
        client.schedule(ns, FP, 1, "bytes", order)
        expected, _ = fetched(client, ns, "bytes")
        client.schedule(ns, FP, 1, "shm", order)
        got, planes = fetched(client, ns, "shm", shared_memory=True, ring_bytes=RING, max_frame_bytes=16 << 10)
    assert planes == {"shared_memory"}
    assert got == expected and all(v is not None for *_, v in got)
    assert {len(v) > RING for *_, v in got} == {True, False}  # 160 KB entries beside 4 KB ones


@pytest.mark.slow
def test_a_corrupt_entry_is_a_counted_miss_in_its_place_on_both_planes(shm_dir, tmp_path):
    """The daemon verifies entries as it decodes them into the frame or the ring; a bad one is a miss."""
    others = {i: np.full(8192, i, np.uint8) for i in (1, 3)}
    env = {"ACTCACHE_SHM_DIR": str(shm_dir)}
    with run_daemon("--encoding", "raw", cache_dir=tmp_path / "c", env=env) as daemon:
        with daemon.client() as client:
            ns = client.open("bad").namespace_id
            client.put(ns, FP, 1, [(2, 0, encode_entry(MARKER_SPEC, [MARKER]))] +
                       [(i, 0, encode_entry(MARKER_SPEC, [a])) for i, a in others.items()])
        daemon.stop()
        flip_marker_byte(tmp_path / "c")
        daemon.start()
        with daemon.client() as client:
            for shared_memory, sid in ((True, "shm"), (False, "bytes")):
                client.schedule(ns, FP, 1, sid, np.array([1, 2, 3], np.uint64))
                got, planes = fetched(client, ns, sid, shared_memory=shared_memory, ring_bytes=RING)
                assert planes == {"shared_memory" if shared_memory else "bytes"}
                assert [sample for _, sample, _, _ in got] == [1, 2, 3]
                assert got[1][3] is None  # corrupt: a miss in its place (the shm run deleted it)
                for _, sample, _, value in (got[0], got[2]):
                    assert bytes(decode_entry(value)[1]) == others[sample].tobytes()
            counters = next(p for p in client.stats().prefetch if p.namespace == "bad").counters
            assert (counters.hits, counters.misses, counters.corrupt) == (4, 2, 1)


def test_the_next_fetch_of_a_client_reuses_the_ring_of_its_last(shm_dir):
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client() as client:
        ns = client.open("reuse-next").namespace_id
        put_range(client, ns, range(0, 300, 2))  # odd ids are misses
        order = np.random.default_rng(5).permutation(300).astype(np.uint64)
        for schedule_id in ("a", "b", "c", "d"):
            client.schedule(ns, FP, 1, schedule_id, order)
        expected, _ = fetched(client, ns, "a")  # bytes
        shm = dict(shared_memory=True, ring_bytes=RING, max_frame_bytes=8 << 10)
        first, planes = fetched(client, ns, "b", **shm)
        (ring,) = client.segments.paths()  # the ended stream's mapping waits for the next Fetch
        second, planes_again = fetched(client, ns, "c", start=100, **shm)  # parked before the last stream ended
        assert first == expected and second == expected[100:]
        assert planes == planes_again == {"shared_memory"}
        assert client.segments.paths() == [ring]  # served in the same ring, restarted at position 100
        stats = client.stats()
        assert (stats.rings_created_total, stats.rings_reused_total) == (1, 1)
        client.schedule(ns, FP, 1, "e", order)
        third, _ = fetched(client, ns, "d", shared_memory=True, ring_bytes=2 * RING, max_frame_bytes=8 << 10)
        assert third == expected
        (_, larger) = client.segments.paths()  # too small for it: a new ring; the small one still waits
        stats = client.stats()
        assert (stats.rings_created_total, stats.rings_reused_total) == (2, 1)
        fourth, _ = fetched(client, ns, "e", **shm)  # a ring up to twice the size asked serves it
        assert fourth == expected and client.segments.paths() == [ring, larger]
        stats = client.stats()
        assert (stats.rings_created_total, stats.rings_reused_total) == (2, 2)
        client.segments.clear()
        assert segments(shm_dir) == []


@pytest.mark.slow
def test_the_ring_of_a_stream_left_midway_serves_the_next_fetch_exactly(shm_dir):
    """A client that stops reading cancels the call while the daemon is still writing frames into the ring;
    the ring's next stream (the same client's next Fetch) gets exactly the stored values."""
    with run_daemon(env={"ACTCACHE_SHM_DIR": str(shm_dir)}) as daemon, daemon.client() as client:
        ns = client.open("left").namespace_id
        put_range(client, ns, range(300))
        order = np.random.default_rng(7).permutation(300).astype(np.uint64)
        client.schedule(ns, FP, 1, "all", order)
        expected = fetched(client, ns, "all")[0]
        shm = dict(shared_memory=True, ring_bytes=RING, max_frame_bytes=8 << 10)
        for i in range(5):
            client.schedule(ns, FP, 1, f"left{i}", order)
            for n, _ in enumerate(client.fetch_batches(ns, f"left{i}", **shm)):
                if n == 2:
                    break  # cancels the call mid-stream
            client.schedule(ns, FP, 1, f"next{i}", order)
            assert fetched(client, ns, f"next{i}", **shm)[0] == expected
        assert client.stats().rings_reused_total >= 1
