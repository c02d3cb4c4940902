"""Schedule/Fetch through a real daemon process and a real LMDB."""

import json
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from actcache._proto import actcache_pb2 as pb
from actcache.codec import Codec, DType, TensorSpec, decode_entry, encode_entry
from actcache.errors import DaemonUnavailable, FetchAborted, InvalidRequest, NamespaceNotFound, ScheduleNotFound
from actcache.testing import run_daemon, wait_until

FP = bytes(range(16))
SPEC = [TensorSpec(DType.float32, (8, 32, 32))]  # 32 KiB raw


def tensor(i: int) -> np.ndarray:
    return np.maximum(np.random.default_rng(i).standard_normal((8, 32, 32), dtype=np.float32), 0)


def put_range(client, ns, ids) -> dict[int, bytes]:
    stored = {i: encode_entry(SPEC, [tensor(i)]) for i in ids}
    client.put(ns, FP, 1, list((i, 0, v) for i, v in stored.items()))
    return stored


def prefetch_of(stats, namespace: str):
    return next(p for p in stats.prefetch if p.namespace == namespace)


def test_an_order_with_nothing_stored_is_not_read_ahead_and_its_fetch_serves_what_is_stored_by_then(client):
    """A write epoch's push (report_present, every entry absent) starts no reader: nothing to read ahead."""
    ns = client.open("absent").namespace_id
    order = np.arange(12, dtype=np.uint64)
    reply = client.schedule(ns, FP, 1, "writes", order, report_present=True)
    assert reply.present == bytes(12)
    status = next(s for s in client.stats().schedules if s.schedule_id == "writes")
    assert status.state == "idle" and status.read == 0
    stored = put_range(client, ns, range(0, 12, 2))  # stored during the epoch
    got = {sid: value for batch in client.fetch_batches(ns, "writes") for _, sid, _, value in batch}
    assert {sid: bytes(decode_entry(v)[1]) for sid, v in got.items() if v is not None} == {
        sid: bytes(decode_entry(v)[1]) for sid, v in stored.items()}


@pytest.mark.slow
def test_chunked_order_of_200k_ids_is_preserved_with_misses_in_place(client):
    ns = client.open("order").namespace_id
    put_range(client, ns, range(0, 400, 4))
    order = np.random.default_rng(1).permutation(200_000).astype(np.uint64)
    variants = (order % 3 == 0).astype(np.uint16)  # variant 1 never stored: a miss even for stored ids
    reply = client.schedule(ns, FP, 1, "rank0-epoch0", order, variants, chunk_ids=30_000)
    assert (reply.length, reply.replaced) == (200_000, False)
    position = 0
    for batch in client.fetch_batches(ns, "rank0-epoch0"):
        assert batch.start == position
        assert np.array_equal(np.asarray(batch.sample_ids, np.uint64), order[position : position + len(batch)])
        for pos, sid, variant, value in batch:
            expected_hit = sid < 400 and sid % 4 == 0 and variant == 0
            assert (value is not None) == expected_hit, (pos, sid, variant)
            if value is not None:
                header, raw = decode_entry(value)
                assert header.codec in (Codec.raw, Codec.raw_verified)  # uncompressed either way
                np.testing.assert_array_equal(np.frombuffer(raw, np.float32).reshape(8, 32, 32), tensor(sid))
        position += len(batch)
    assert position == 200_000


def test_a_push_answers_which_entries_are_stored(client):
    ns = client.open("present").namespace_id
    put_range(client, ns, range(0, 60, 3))
    order = np.random.default_rng(2).permutation(90).astype(np.uint64)
    variants = (order % 2).astype(np.uint16)  # variant 1 is never stored
    reply = client.schedule(ns, FP, 1, "with-present", order, variants, chunk_ids=16, report_present=True)
    expected = [int(s) < 60 and s % 3 == 0 and v == 0 for s, v in zip(order, variants)]
    assert list(map(bool, reply.present)) == expected
    assert np.array_equal(client.contains(ns, FP, 1, order, variants), expected)
    assert client.schedule(ns, FP, 1, "without", order).present == b""  # only when asked
    for schedule_id in ("with-present", "without"):  # read to the end: their read-ahead is freed
        assert sum(len(b) for b in client.fetch_batches(ns, schedule_id)) == 90


def test_an_order_in_one_chunk_schedules_as_in_many(client):
    ns = client.open("one-chunk").namespace_id
    put_range(client, ns, range(0, 60, 3))
    order = np.random.default_rng(3).permutation(90).astype(np.uint64)
    variants = (order % 2).astype(np.uint16)
    unary = client.schedule(ns, FP, 1, "unary", order, variants, report_present=True)  # one chunk
    streamed = client.schedule(ns, FP, 1, "streamed", order, variants, chunk_ids=16, report_present=True)
    assert (unary.length, unary.present) == (streamed.length, streamed.present) == (90, streamed.present)
    assert sum(streamed.present) == sum(1 for s, v in zip(order, variants) if s < 60 and s % 3 == 0 and v == 0)
    served = {sid: [(variant, value) for _, s, variant, value in client.fetch(ns, sid)] for sid in ("unary", "streamed")}
    assert served["unary"] == served["streamed"]
    assert not client.schedule(ns, FP, 1, "again", order[:5]).replaced
    assert client.schedule(ns, FP, 1, "again", order[:5]).replaced  # pushing an id again replaces it
    assert sum(len(b) for b in client.fetch_batches(ns, "again")) == 5
    with pytest.raises(NamespaceNotFound):
        client.schedule(ns + 12345, FP, 1, "nowhere", order[:5])
    with pytest.raises(InvalidRequest, match="schedule id .bad id!. is invalid"):
        client.schedule(ns, FP, 1, "bad id!", order[:5])


def test_stats_counters_are_exact_on_a_known_workload(daemon, client):
    ns = client.open("exact").namespace_id
    stored = put_range(client, ns, range(0, 60, 3))  # 20 entries
    order = list(range(60))  # 20 hits, 40 misses
    client.schedule(ns, FP, 1, "e0", order)
    served = sum(len(v) for *_, v in client.fetch(ns, "e0") if v is not None)
    raw_entry = len(encode_entry(SPEC, [tensor(0)], zstd_level=0))
    assert served == 20 * raw_entry  # entries arrive uncompressed
    stats = client.stats()
    counters = prefetch_of(stats, "exact").counters
    stored_bytes = next(g.bytes for g in stats.groups if g.namespace == "exact")
    assert (counters.hits, counters.misses, counters.corrupt) == (20, 40, 0)
    assert counters.hit_ratio == pytest.approx(20 / 60)
    assert counters.served_bytes == served
    assert counters.read_bytes == stored_bytes  # every stored value read exactly once
    assert counters.ready_on_ask + counters.stalls == 60
    assert stats.fetches_total >= 1 and stats.schedules_total >= 1
    assert stats.explicit_reads_total >= 20 and stats.fallback_reads_total == 0
    assert not [s for s in stats.schedules if s.namespace == "exact"]  # served to its end: retired
    assert len(stored) == 20

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "actcache", *args, "--socket", str(daemon.socket)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    as_json = json.loads(cli("stats", "--json"))
    row = next(p for p in as_json["prefetch"] if p["namespace"] == "exact")
    assert (int(row["counters"]["hits"]), int(row["counters"]["misses"])) == (20, 40)
    human = cli("stats")
    assert "prefetch budget" in human and "20 hits, 40 misses (hit ratio 33.3%" in human


@pytest.mark.slow
def test_budget_holds_under_concurrent_schedules():
    budget = 1 << 20
    with run_daemon("--prefetch-bytes", str(budget), "--max-entry-bytes", "256KiB") as d, d.client() as c:
        ns = c.open("shared").namespace_id
        put_range(c, ns, range(200))
        errors, peaks = [], []

        def rank(k: int) -> None:
            try:
                with d.client() as mine:
                    order = np.random.default_rng(k).permutation(200)
                    mine.schedule(ns, FP, 1, f"rank{k}", order)
                    got = [sid for _, sid, _, v in mine.fetch(ns, f"rank{k}") if v is not None]
                    assert got == order.tolist()
            except Exception as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            s = c.stats()
            peaks.append(s.prefetch_buffered_bytes)
            for sc in s.schedules:
                assert sc.start <= sc.served <= sc.ready <= sc.read <= sc.length
            time.sleep(0.01)
        for t in threads:
            t.join()
        stats = c.stats()
    assert errors == []
    assert max(peaks) <= budget
    assert 0 < stats.prefetch_max_buffered_bytes <= budget == stats.prefetch_budget_bytes
    assert prefetch_of(stats, "shared").counters.hits == 800


def test_cancelled_fetch_frees_its_memory(client):
    ns = client.open("cancel").namespace_id
    put_range(client, ns, range(300))
    client.schedule(ns, FP, 1, "e0", range(300))
    stream = client.fetch_batches(ns, "e0", max_frame_bytes=64 << 10)
    next(stream)
    wait_until(lambda: client.stats().prefetch_buffered_bytes > 0)
    stream.close()  # cancels the call
    wait_until(lambda: client.stats().prefetch_buffered_bytes == 0)
    status = next(s for s in client.stats().schedules if s.schedule_id == "e0" and s.namespace == "cancel")
    assert status.state in ("cancelled", "idle")
    # The schedule is still there: resume from where the consumer was.
    assert [pos for pos, *_ in client.fetch(ns, "e0", start=290)] == list(range(290, 300))


def test_next_epoch_pushed_while_the_current_one_is_fetched(client):
    ns = client.open("epochs").namespace_id
    put_range(client, ns, range(100))
    orders = [np.random.default_rng(e).permutation(100) for e in range(3)]
    client.schedule(ns, FP, 1, "epoch0", orders[0])
    for epoch in range(3):
        got = []
        for i, (_, sid, _, value) in enumerate(client.fetch(ns, f"epoch{epoch}")):
            assert value is not None
            got.append(sid)
            if i == 50 and epoch < 2:  # push the next epoch's order mid-epoch, as a loader does
                client.schedule(ns, FP, 1, f"epoch{epoch + 1}", orders[epoch + 1])
        assert got == orders[epoch].tolist()
    assert prefetch_of(client.stats(), "epochs").counters.hits == 300


def test_replaced_and_unknown_schedules_are_clear_errors(client):
    ns = client.open("replace").namespace_id
    put_range(client, ns, range(200))
    client.schedule(ns, FP, 1, "e0", range(200))
    stream = client.fetch(ns, "e0", max_frame_bytes=32 << 10)
    next(stream)
    assert client.schedule(ns, FP, 1, "e0", [5, 6]).replaced
    with pytest.raises(FetchAborted, match="replaced by a new push.*ABORTED"):
        list(stream)
    assert [sid for _, sid, _, _ in client.fetch(ns, "e0")] == [5, 6]
    with pytest.raises(ScheduleNotFound, match="no schedule 'e0'.*NOT_FOUND"):
        list(client.fetch(ns, "e0"))
    with pytest.raises(NamespaceNotFound, match="namespace id 999"):
        list(client.fetch(999, "e0"))
    with pytest.raises(InvalidRequest, match="schedule id 'bad id!' is invalid"):
        client.schedule(ns, FP, 1, "bad id!", [1])
    with pytest.raises(InvalidRequest, match="fingerprint must be 16 bytes"):
        client.schedule(ns, b"short", 1, "e1", [1])
    with pytest.raises(InvalidRequest, match="sample id -1 is negative"):
        client.schedule(ns, FP, 1, "e1", [1, -1])


def test_plain_repeated_fields_work_for_other_clients(client):
    ns = client.open("stubs").namespace_id
    put_range(client, ns, [1, 2])
    chunks = [
        pb.ScheduleChunk(namespace_id=ns, fingerprint=FP, depth=1, schedule_id="s", sample_ids=[2, 3]),
        pb.ScheduleChunk(sample_ids=[1]),
    ]
    reply = client._call("Schedule")(iter(chunks), timeout=10)
    assert reply.length == 3
    assert [v is not None for *_, v in client.fetch(ns, "s")] == [True, False, True]
    bad = pb.ScheduleChunk(namespace_id=ns, fingerprint=FP, depth=1, schedule_id="t", sample_ids=[1],
                           packed_sample_ids=b"\0" * 8)
    with pytest.raises(grpc.RpcError) as info:
        client._call("Schedule")(iter([bad]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "both sample_ids and packed_sample_ids" in info.value.details()


@pytest.mark.slow
def test_shutdown_ends_fetch_streams_at_once_with_unavailable():
    with run_daemon("--encoding", "raw") as d, d.client(retries=1) as c:
        ns = c.open("stop").namespace_id
        put_range(c, ns, range(300))
        c.schedule(ns, FP, 1, "e0", range(300))
        stream = c.fetch(ns, "e0", max_frame_bytes=32 << 10)
        next(stream)
        assert d.stop() == 0  # SIGTERM while a Fetch is open: drains and exits cleanly
        with pytest.raises(DaemonUnavailable):
            list(stream)


def test_schedule_and_fetch_on_a_protected_namespace(daemon):
    import numpy as np

    from actcache.codec import DType, TensorSpec, encode_entry

    fingerprint = bytes(range(16))
    with daemon.client() as client:
        handle = client.open("prefetch-private", secret="k").namespace_id
        value = encode_entry([TensorSpec(DType.int32, (4,))], [np.arange(4, dtype=np.int32)])
        client.put(handle, fingerprint, 1, [(i, 0, value) for i in range(5)])
        client.schedule(handle, fingerprint, 1, "epoch0", np.arange(8, dtype=np.uint64))
        got = [(position, entry is not None) for position, _, _, entry in client.fetch(handle, "epoch0")]
        assert got == [(i, i < 5) for i in range(8)]
