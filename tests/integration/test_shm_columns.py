"""Fetch frames of columns (FetchRequest.columns) against a real daemon: layout, holds, a full ring."""

import threading

import numpy as np

from actcache.codec import DType, TensorSpec, encode_entry
from actcache.shm import COLUMN_ALIGN
from tests.integration.conftest import SHM_FP as FP
from tests.integration.conftest import SMALL_RING as RING
from tests.integration.conftest import fetched, put_range, tensor_of

N = 200  # 1 KiB entries: about three turns of the smallest ring


class _Token:
    """A holder for ``ClientSegment.hold`` (anything weakly referenceable)."""


def _expected(client, ns, name: str) -> dict[int, bytes]:
    client.schedule(ns, FP, 1, f"{name}-bytes", np.arange(N, dtype=np.uint64))
    return {pos: v for pos, _, _, v in fetched(client, ns, f"{name}-bytes")[0]}


def test_a_frame_of_columns_holds_each_tensor_contiguous_and_rebuilds_its_entries(client):
    ns = client.open("columns").namespace_id
    put_range(client, ns, range(N))
    expected = _expected(client, ns, "layout")
    client.schedule(ns, FP, 1, "cols", np.arange(N, dtype=np.uint64))
    column_frames = 0
    for batch in client.fetch_batches(ns, "cols", shared_memory=True, ring_bytes=RING, max_frame_bytes=16 << 10,
                                      columns=True):
        assert [bytes(v) for v in batch.values] == [expected[p] for p in range(batch.start, batch.start + len(batch))]
        run = batch.columns
        if run is None:  # a run that would wrap the ring: slots
            continue
        column_frames += 1
        assert run.count == len(batch) and all(at % COLUMN_ALIGN == 0 for at in run.starts)
        column = np.frombuffer(run.segment.view, np.float32, 256 * run.count, run.starts[0])
        sids = batch.sample_ids
        assert np.array_equal(column, np.concatenate([tensor_of(int(s)).ravel() for s in sids]))
    assert column_frames >= N // 16 // 2  # most frames (16 entries each)


def test_held_columns_stay_intact_and_a_ring_full_of_them_is_served_in_messages(client):
    """The client holds every frame: the ring fills, the daemon sends the frame the client waits for in its
    message (counted as inline), and no held column is written over."""
    ns = client.open("held").namespace_id
    put_range(client, ns, range(N))
    expected = _expected(client, ns, "held")
    client.schedule(ns, FP, 1, "held", np.arange(N, dtype=np.uint64))
    kept, tokens, inline, done = [], [], [0], threading.Event()

    def consume() -> None:
        for batch in client.fetch_batches(ns, "held", shared_memory=True, ring_bytes=RING, max_frame_bytes=8 << 10,
                                          columns=True):
            inline[0] += batch.inline
            if batch.columns is not None:
                tokens.append(_Token())
                batch.columns.segment.hold(batch.start, tokens[-1])
                kept.append(batch)
            else:
                assert [bytes(v) for v in batch.values] == [expected[p] for p in range(batch.start,
                                                                                         batch.start + len(batch))]
        done.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    assert done.wait(60), "the stream stalled with the ring full of held frames"
    assert inline[0] > 0 and kept
    for batch in kept:  # still what the daemon wrote, after the stream ran on
        assert [bytes(v) for v in batch.values] == [expected[p] for p in range(batch.start, batch.start + len(batch))]
    assert not client.segments.paths()  # a held segment is never offered to another stream
    tokens.clear()


def test_entries_of_several_tensors_come_as_one_column_each_and_rebuild_byte_for_byte(client):
    specs = [TensorSpec(DType.float32, (3, 5)), TensorSpec(DType.int64, (7,)), TensorSpec(DType.bool, (3,))]
    rng = np.random.default_rng(0)
    values = {i: [rng.standard_normal((3, 5), dtype=np.float32), rng.integers(0, 9, 7), rng.integers(0, 2, 3) > 0]
              for i in range(40)}
    ns = client.open("several").namespace_id
    client.put(ns, FP, 2, [(i, 0, encode_entry(specs, v)) for i, v in values.items()])
    client.schedule(ns, FP, 2, "several", np.arange(40, dtype=np.uint64))
    batches = list(client.fetch_batches(ns, "several", shared_memory=True, ring_bytes=RING, columns=True))
    runs = [b.columns for b in batches if b.columns is not None]
    assert runs and all(at % COLUMN_ALIGN == 0 for run in runs for at in run.starts)
    assert [bytes(v) for b in batches for v in b.values] == [encode_entry(specs, values[i]) for i in range(40)]
