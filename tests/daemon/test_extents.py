"""Explicit reads: located extents hold exactly the stored bytes; anything unrecognized falls back to the map."""

import os

import numpy as np
import pytest

from actcache.codec import DType, TensorSpec, encode_entry
from actcache.daemon.config import StoreConfig
from actcache.daemon.store import Store
from actcache.daemon.store._extents import Extent, ExtentHints, PageCacheGuess
from actcache.keys import encode_key, group_prefix

FP = b"E" * 16
SIZES = [16, 1000, 3000, 4096 - 48, 4096, 70_000, 1 << 20]  # inline, around a page, many overflow pages


def entry(seed: int, n: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return encode_entry([TensorSpec(DType.uint8, (n,))], [data])


@pytest.fixture(params=[True, False], ids=["explicit", "map"])
def store(tmp_path, request):
    s = Store(StoreConfig(dir=tmp_path / "c", encoding="raw", explicit_reads=request.param))
    yield s
    s.close()


def test_reads_return_the_stored_bytes_for_every_size(store):
    ns = store.open_namespace("x").id
    values = {i: entry(i, n) for i, n in enumerate(SIZES)}
    store.put(ns, FP, 1, [(i, 0, v) for i, v in values.items()])
    keys = [(i, 0) for i in values] + [(99, 0)]
    assert store.get(ns, FP, 1, keys) == [*values.values(), None]
    with store.read_session() as session:
        for i, value in values.items():
            key = encode_key(ns, FP, 1, i)
            extent = session.locate(key)
            assert extent.length == len(value)
            assert bytes(session.read(key, extent)) == value
    counts = store.read_counts()
    if store.config.explicit_reads:
        large = sum(len(v) > 2048 for v in values.values())
        assert counts == {"explicit_reads": 2 * large, "fallback_reads": 0, "cached_copies": 0}
    else:
        assert counts["explicit_reads"] == 0


def test_a_wrong_extent_falls_back_to_the_map(store):
    ns = store.open_namespace("x").id
    value = entry(1, 100_000)
    store.put(ns, FP, 1, [(1, 0, value), (2, 0, entry(2, 300_000))])  # the other value spans the wrong extent
    key, other = encode_key(ns, FP, 1, 1), encode_key(ns, FP, 1, 2)
    with store._env.begin(db=store._state.entries, buffers=True) as txn:
        cursor = txn.cursor()
        assert cursor.set_key(other)
        first_page, _ = store._file.pages.overflow_node(cursor, other)
    # Points into the middle of the other value: the page header check rejects it, in either mode.
    wrong = Extent.at_page(first_page + 1, len(value), store._file.page_size)
    with store.read_session() as session:
        assert bytes(session.read(key, wrong)) == value
    assert store.read_counts() == {"explicit_reads": 0, "fallback_reads": 1, "cached_copies": 0}


def test_probe_and_stored_length(store):
    ns = store.open_namespace("x").id
    value = entry(3, 50_000)
    store.put(ns, FP, 1, [(3, 0, value)])
    key = encode_key(ns, FP, 1, 3)
    store.get(ns, FP, 1, [(3, 0)])  # now in the page cache
    assert store.probe([key, encode_key(ns, FP, 1, 4)]) == [hasattr(os, "RWF_NOWAIT"), None]
    with store._env.begin(db=store._state.entries, buffers=True) as txn:
        cursor = txn.cursor()
        assert store._file.pages.stored_length(cursor, key) == len(value)
        assert store._file.pages.stored_length(cursor, encode_key(ns, FP, 1, 4)) is None


def test_one_lookup_per_leaf_page_learns_where_every_value_beside_it_is(tmp_path):
    store = Store(StoreConfig(dir=tmp_path / "c", encoding="raw"))
    ns = store.open_namespace("x").id
    count = 600  # 40-byte leaf nodes: several leaf pages
    store.put(ns, FP, 1, [(i, 0, entry(i, 3000 + i)) for i in range(count)] + [(count, 0, entry(0, 16))])
    keys = [encode_key(ns, FP, 1, i) for i in range(count + 1)]
    hints = ExtentHints(group_prefix(ns, FP, 1), np.arange(count + 1, dtype=np.uint64)[::-1].copy())
    with store.read_session() as session:
        located = [session.locate(key) for key in keys]
        first = session.locate_hinted(keys[0], hints)
        learned = hints.known
        assert first == located[0] and 40 < learned < count  # its leaf page, not the whole group
        lookups = 1
        for key, extent in zip(keys[1:], located[1:]):
            if hints.take(key) is None:  # not learned yet: this lookup reads its leaf page
                lookups += 1
                hinted = session.locate_hinted(key, hints)
            else:
                hinted = extent  # taken: each hint is used once
            assert hinted == extent
        assert lookups < count // 40  # one per leaf page
        assert located[count].inline is not None  # a small value stays inside its leaf: never hinted
    store.close()


def test_hints_are_only_hints_a_replaced_value_is_read_from_where_it_is_now(tmp_path):
    store = Store(StoreConfig(dir=tmp_path / "c", encoding="raw"))
    ns = store.open_namespace("x").id
    store.put(ns, FP, 1, [(i, 0, entry(i, 20_000)) for i in range(40)])
    keys = [encode_key(ns, FP, 1, i) for i in range(40)]
    hints = ExtentHints(group_prefix(ns, FP, 1), np.arange(40, dtype=np.uint64))
    store.probe(keys[:1], hints)  # learns the others' extents
    assert hints.known == 39
    replaced = entry(99, 50_000)
    store.put(ns, FP, 1, [(5, 0, replaced)])  # moves to other pages
    assert all(isinstance(r, bool) for r in store.probe(keys[1:], hints, start=1))  # stale: a useless hint at worst
    assert store.get(ns, FP, 1, [(5, 0), (6, 0)]) == [replaced, entry(6, 20_000)]
    with store.read_session() as session:
        assert bytes(session.read(keys[5], session.locate(keys[5]))) == replaced
    store.close()


def test_extent_hints_keep_only_the_schedules_own_keys_each_used_once():
    ids, variants = np.array([7, 3, 9], dtype=np.uint64), np.array([1, 0, 2], dtype=np.uint16)
    hints = ExtentHints(group_prefix(5, FP, 2), ids, variants)
    page = [(encode_key(5, FP, 2, sid, var), Extent(n * 4096 + 16, 1000 + n))
            for n, (sid, var) in enumerate([(3, 0), (7, 1), (7, 0), (8, 0), (9, 2)])]
    page.append((encode_key(5, FP, 3, 9, 2), Extent(99 * 4096 + 16, 1)))  # another depth's entry
    page.append((encode_key(6, FP, 2, 3, 0), Extent(98 * 4096 + 16, 1)))  # another namespace's
    hints.learn(page)
    assert hints.known == 3  # (7, 0) is another variant, 8 another rank's sample
    assert hints.take(encode_key(5, FP, 2, 7, 1)) == Extent(1 * 4096 + 16, 1001)
    assert hints.take(encode_key(5, FP, 2, 7, 1)) is None  # used once
    assert hints.take(encode_key(5, FP, 3, 9, 2)) is None and hints.take(encode_key(5, FP, 2, 8, 0)) is None
    assert hints.take(encode_key(5, FP, 2, 9, 2)) == Extent(4 * 4096 + 16, 1004) and hints.known == 1
    assert ExtentHints(group_prefix(5, FP, 2), np.array([], dtype=np.uint64)).take(page[0][0]) is None


def test_replacing_and_deleting_keep_usage_exact(store):
    ns = store.open_namespace("x").id
    store.put(ns, FP, 1, [(1, 0, entry(1, 50_000))])
    result = store.put(ns, FP, 1, [(1, 0, entry(2, 20_000))])
    assert result.replaced == 1
    assert store.used_bytes(ns) == len(entry(2, 20_000))
    assert store.discard_corrupt([encode_key(ns, FP, 1, 1)]) == 0  # intact entries survive
    assert store.get(ns, FP, 1, [(1, 0)]) == [entry(2, 20_000)]


def test_a_reader_whose_values_are_cached_copies_them_from_the_map_and_checks_again(store):
    ns = store.open_namespace("x").id
    values = [entry(i, 20_000) for i in range(200)]
    store.put(ns, FP, 1, [(i, 0, v) for i, v in enumerate(values)])
    store.get(ns, FP, 1, [(i, 0) for i in range(200)])  # now in the page cache
    guess = PageCacheGuess()
    explicit = []
    with store.read_session(guess) as session:
        for i, value in enumerate(values):
            key = encode_key(ns, FP, 1, i)
            extent = session.locate(key)
            explicit.append(extent.inline is None)
            assert bytes(session.read(key, extent)) == value
    if not (store.config.explicit_reads and hasattr(os, "RWF_NOWAIT")):
        return  # without explicit reads (or a kernel that tells what is cached) there is nothing to guess
    warm = PageCacheGuess.WARM_AFTER
    assert all(explicit[:warm]) and not any(explicit[warm : warm + 10])
    # then one lookup in CHECK_EVERY is read explicitly again
    assert sum(explicit[warm:]) == (len(values) - warm) // PageCacheGuess.CHECK_EVERY
    guess.saw(False)  # a value that was not cached: explicit reads again
    assert not guess.use_map()
    assert store.read_counts()["cached_copies"] == len(values) - sum(explicit)
    assert store.read_counts()["fallback_reads"] == 0


def test_a_warm_reader_copies_a_run_of_values_in_one_call_and_reads_a_run_due_for_a_check_one_by_one(store):
    ns = store.open_namespace("x").id
    values = {i: entry(i, 20_000) for i in range(0, 80, 2)}
    store.put(ns, FP, 1, list((i, 0, v) for i, v in values.items()))
    keys = [encode_key(ns, FP, 1, i) for i in range(80)]  # every other one is missing
    guess = PageCacheGuess()
    explicit = store.config.explicit_reads
    with store.read_session(guess) as session:
        cold = session.copy_run(keys[:4])  # no explicit read has found a value cached yet
        assert cold is None if explicit else cold == [values.get(i) for i in range(4)]  # the plain path copies
        for _ in range(PageCacheGuess.WARM_AFTER):
            guess.saw(True)
        assert session.copy_run(keys[:32]) == [values.get(i) for i in range(32)]
        # lookup 64 is due for a check: the run's first stored value is asked whether it is cached
        assert session.copy_run(keys[32:64]) == [values.get(i) for i in range(32, 64)]
        if explicit:
            store._file.resident = lambda extent: False  # the kernel now says: not in the page cache
            assert session.copy_run(keys[64:80]) == [values.get(i) for i in range(64, 80)]  # no check due
            assert session.copy_run(keys[:48]) is None  # lookup 128 is due: the first value is not cached
            assert not guess.warm  # explicit reads again until they find values cached
    assert store.read_counts()["cached_copies"] == (40 if explicit else 0)


class _CountingCursor:
    """An LMDB cursor that records the keys of its ``set_range`` lookups."""

    def __init__(self, cursor) -> None:
        self._cursor, self.lookups = cursor, []

    def __getattr__(self, name):
        return getattr(self._cursor, name)

    def set_range(self, key):
        self.lookups.append(key)
        return self._cursor.set_range(key)


def test_presence_is_read_from_whole_leaf_pages_and_matches_a_lookup_per_key(tmp_path):
    store = Store(StoreConfig(dir=tmp_path / "c", encoding="raw"))
    ns = store.open_namespace("x").id
    stored = [i for i in range(3, 900, 2)]  # gaps between stored ids, several leaf pages
    store.put(ns, FP, 1, [(i, 0, entry(i, 3000 if i % 10 else 16)) for i in stored])  # some small, inline
    store.put(ns, FP, 2, [(i, 0, entry(i, 3000)) for i in range(0, 900, 3)])  # another depth, interleaved
    asked = [encode_key(ns, FP, 1, i) for i in [*range(0, 950), 5, 5, 2**63]]  # before, between, after, repeated
    asked = [asked[i] for i in np.random.default_rng(0).permutation(len(asked))]
    with store._env.begin(db=store._state.entries, buffers=True) as txn:
        expected = [txn.cursor().set_key(key) for key in asked]
        cursor = _CountingCursor(txn.cursor())
        got = store._file.pages.present_keys(cursor, asked)
    assert got == expected and sum(got) == len(stored) + 2
    assert len(cursor.lookups) < len(stored) // 20  # one lookup per leaf page, not per key
    store.close()


def test_presence_of_keys_with_nothing_stored_in_their_range(tmp_path):
    store = Store(StoreConfig(dir=tmp_path / "c", encoding="raw"))
    ns = store.open_namespace("x").id
    store.put(ns, FP, 1, [(i, 0, entry(i, 3000)) for i in range(100)])  # below the keys asked
    store.put(ns, FP, 3, [(i, 0, entry(i, 3000)) for i in range(100)])  # above them
    asked = [encode_key(ns, FP, 2, i) for i in np.random.default_rng(0).permutation(500)]
    with store._env.begin(db=store._state.entries, buffers=True) as txn:
        cursor = _CountingCursor(txn.cursor())
        assert store._file.pages.present_keys(cursor, asked) == [False] * 500
        assert store._file.pages.present_keys(cursor, []) == []
    assert len(cursor.lookups) == 1
    store.put(ns, FP, 2, [(7, 0, entry(7, 3000))])
    with store._env.begin(db=store._state.entries, buffers=True) as txn:
        got = store._file.pages.present_keys(txn.cursor(), asked)
    assert [key for key, present in zip(asked, got) if present] == [encode_key(ns, FP, 2, 7)]
    store.close()

