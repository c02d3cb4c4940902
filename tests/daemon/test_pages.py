"""The leaf-page reader: checked at store open against this LMDB; a layout it does not read turns it off."""

import logging
import struct

import numpy as np
import pytest

from actcache.codec import DType, TensorSpec, encode_entry
from actcache.daemon.config import PrefetchConfig, StoreConfig
from actcache.daemon.prefetch import Prefetcher
from actcache.daemon.prefetch._schedule import Schedule
from actcache.daemon.service._service import ActCacheService
from actcache.daemon.store import Store, _pages
from actcache.entries import EntryBatch
from actcache.keys import encode_key

FP = b"P" * 16
SIZES = [16, 1000, 3000, 4096, 70_000]  # inline and overflow values


def entry(i: int) -> bytes:
    n = SIZES[i % len(SIZES)]
    return encode_entry([TensorSpec(DType.uint8, (n,))], [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)])


def served(store, ns: int, order) -> dict[int, bytes | None]:
    """What a Fetch of ``order`` serves, by sample id."""
    prefetcher = Prefetcher(store, PrefetchConfig(decode_threads=2))
    try:
        prefetcher.push(Schedule(ns, "e0", FP, 1, np.asarray(order, np.uint64), None))
        out = {}
        for frame in prefetcher.attach(ns, "e0", 0).frames(1 << 20):
            for _, sid, _, value in EntryBatch.from_frame(frame):
                out[sid] = None if value is None else bytes(value)
        return out
    finally:
        prefetcher.close()


def stats(store):
    prefetcher = Prefetcher(store, PrefetchConfig())
    try:
        return ActCacheService(store, prefetcher, max_message_bytes=1 << 20).Stats(None, None)
    finally:
        prefetcher.close()


def check_serving(store) -> None:
    """Values put are the values read, served and found, by every path."""
    ns = store.open_namespace("pages").id
    values = {i: entry(i) for i in range(0, 400, 2)}  # odd ids are misses
    store.put(ns, FP, 1, list((i, 0, v) for i, v in values.items()))
    assert store.get(ns, FP, 1, [(i, 0) for i in range(400)]) == [values.get(i) for i in range(400)]
    assert store.contains(ns, FP, 1, np.arange(400, dtype=np.uint64)) == [i % 2 == 0 for i in range(400)]
    assert store.probe([encode_key(ns, FP, 1, i) for i in range(4)])[1::2] == [None, None]
    order = np.random.default_rng(0).permutation(400)
    assert served(store, ns, order) == {int(i): values.get(int(i)) for i in order}
    store.put(ns, FP, 1, [(0, 0, entry(2))])  # a replacement: its stored size comes from its leaf node
    assert store.groups()[0].bytes == sum(len(v) for v in values.values()) - len(values[0]) + len(entry(2))


def test_this_lmdbs_layout_is_read_and_the_check_leaves_no_trace(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    store = Store(StoreConfig(dir=tmp_path, encoding="raw"))
    try:
        assert store.page_layout_unrecognized == 0 and store._file.pages.enabled
        with store._env.begin(db=store._state.meta) as txn:
            assert not [key for key, _ in txn.cursor() if key.startswith(b"\xffpage-layout-check")]
        check_serving(store)
        assert store.read_counts()["explicit_reads"] > 0
        assert stats(store).page_layout_unrecognized_total == 0
    finally:
        store.close()
    assert not caplog.records


@pytest.mark.parametrize("wrong", ["byte order", "leaf flag"])
def test_an_unrecognized_layout_turns_the_hints_off_and_serving_stays_correct(tmp_path, monkeypatch, caplog, wrong):
    if wrong == "byte order":
        monkeypatch.setattr(_pages, "_PAGE_BOUNDS", struct.Struct(">QHHHH"))
    else:
        monkeypatch.setattr(_pages, "_P_LEAF", 0x40)
    caplog.set_level(logging.WARNING)
    store = Store(StoreConfig(dir=tmp_path, encoding="raw"))
    try:
        assert store.page_layout_unrecognized == 1 and not store._file.pages.enabled
        [record] = caplog.records
        assert "page layout is not the one this daemon reads" in record.getMessage()
        check_serving(store)
        assert store.read_counts()["explicit_reads"] == 0  # every value copied from the map
        assert stats(store).page_layout_unrecognized_total == 1
    finally:
        store.close()
    assert len(caplog.records) == 1  # logged once


def test_a_key_outside_the_map_or_a_page_not_a_leaf_is_not_recognized(tmp_path):
    store = Store(StoreConfig(dir=tmp_path, encoding="raw"))
    try:
        ns = store.open_namespace("pages").id
        store.put(ns, FP, 1, [(i, 0, entry(4)) for i in range(50)])
        pages = store._file.pages
        key = encode_key(ns, FP, 1, 3)
        with store._env.begin(db=store._state.entries, buffers=True) as txn:
            cursor = txn.cursor()
            assert cursor.set_key(key)
            assert pages.overflow_node(cursor, key) is not None

            class Elsewhere:  # a key in memory outside LMDB's map (as on a page the writer changed)
                def key(self):
                    return memoryview(bytes(cursor.key()))

            assert pages.overflow_node(Elsewhere(), key) is None and pages.leaf_nodes(Elsewhere()) == []
            assert pages.overflow_node(cursor, encode_key(ns, FP, 1, 4)) is None  # not the cursor's key
        assert _pages._leaf_bounds(bytes(4096), 7, 4096) is None  # page 7 would name itself 7
        assert not _pages.is_overflow_page(struct.pack("<QHH", 7, 0, 0x02), 7 * 4096, 4096)
    finally:
        store.close()


def test_the_reader_follows_the_map_when_it_grows(tmp_path):
    store = Store(StoreConfig(dir=tmp_path, map_size_bytes=1 << 20, encoding="raw"))
    try:
        ns = store.open_namespace("pages").id
        before = store.map_size()
        for start in range(0, 600, 50):
            store.put(ns, FP, 1, [(i, 0, entry(3)) for i in range(start, start + 50)])
        assert store.map_size() > before
        with store.read_session() as session:
            extent = session.locate(encode_key(ns, FP, 1, 599))
            assert extent.inline is None  # found through its leaf page, in the moved map
            assert bytes(session.read(encode_key(ns, FP, 1, 599), extent)) == entry(3)
    finally:
        store.close()
