"""The LMDB store in-process: budgets, drop, map growth, persistence, corruption."""

import os
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest

from actcache.codec import DType, TensorSpec, encode_batch, encode_entry
from actcache.daemon.config import StoreConfig
from actcache.daemon.store import Store
from actcache.errors import BudgetExceeded, EntryCorrupt, InvalidRequest, NamespaceNotFound, StoreError
from actcache.keys import encode_key
from actcache.served import to_raw_entry

FP = b"F" * 16


def entry(seed: int, n: int = 4096) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return encode_entry([TensorSpec(DType.uint8, (n,))], [data])


@pytest.fixture
def store(tmp_path):
    s = Store(StoreConfig(dir=tmp_path / "cache", map_size_bytes=1 << 20))
    yield s
    s.close()


def test_put_get_miss_and_replace(store):
    ns = store.open_namespace("job").id
    store.put(ns, FP, 1, [(i, 0, entry(i)) for i in range(10)])
    assert store.get(ns, FP, 1, [(3, 0), (99, 0), (3, 1)]) == [entry(3), None, None]
    result = store.put(ns, FP, 1, [(3, 0, entry(100))])
    assert result.replaced == 1
    assert store.get(ns, FP, 1, [(3, 0)]) == [entry(100)]
    assert store.groups()[0].entries == 10


def test_rows_the_daemon_encoded_are_stored_as_each_entry_put_alone(tmp_path):
    store = Store(StoreConfig(dir=tmp_path / "cache", map_size_bytes=1 << 20, max_entry_bytes=64 << 10))
    try:
        ns = store.open_namespace("rows").id
        specs = [TensorSpec(DType.float32, (4, 3)), TensorSpec(DType.int64, (2,))]
        columns = [np.random.default_rng(j).integers(0, 256, (5, s.nbytes), dtype=np.uint8) for j, s in enumerate(specs)]
        rows = encode_batch(specs, columns)
        ids, variants = np.array([7, 3, 9, 1, 2**40], np.uint64), np.array([0, 1, 0, 65535, 2], np.uint16)
        result = store.put_rows(ns, FP, 2, ids, variants, rows)
        assert (result.entries, result.stored_bytes, result.replaced) == (5, rows.size, 0)
        keys = [(int(i), int(v)) for i, v in zip(ids, variants)]
        assert store.get(ns, FP, 2, keys) == [bytes(r) for r in rows]
        assert store.get(ns, FP, 2, [(7, 1)]) == [None]  # another variant
        assert store.put_rows(ns, FP, 2, ids[:2], None, rows[:2]).replaced == 1  # (7, 0) again; (3, 0) is new
        big = encode_batch([TensorSpec(DType.uint8, (70 << 10,))], [np.zeros((1, 70 << 10), np.uint8)])
        with pytest.raises(InvalidRequest, match="above the 64.0 KiB limit; raise --max-entry-bytes"):
            store.put_rows(ns, FP, 2, ids[:1], None, big)
    finally:
        store.close()


def test_map_grows_instead_of_failing(store):
    ns = store.open_namespace("big").id
    before = store.map_size()
    for start in range(0, 600, 50):
        store.put(ns, FP, 1, [(i, 0, entry(i, 16384)) for i in range(start, start + 50)])
    assert store.map_size() > before
    assert store.get(ns, FP, 1, [(599, 0)]) == [entry(599, 16384)]


def test_concurrent_readers_during_growth(store):
    ns = store.open_namespace("rw").id
    store.put(ns, FP, 0, [(0, 0, entry(0))])
    errors = []

    def read():
        try:
            for _ in range(200):
                assert store.get(ns, FP, 0, [(0, 0)]) == [entry(0)]
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    for start in range(1, 400, 40):
        store.put(ns, FP, 1, [(i, 0, entry(i, 16384)) for i in range(start, start + 40)])
    for t in readers:
        t.join()
    assert errors == []


def test_budgets_then_drop_frees_space(tmp_path):
    one = len(entry(0))
    s = Store(StoreConfig(dir=tmp_path, namespace_budget_bytes=10 * one, budget_bytes=15 * one, encoding="raw"))
    try:
        a, b = s.open_namespace("a").id, s.open_namespace("b").id
        s.put(a, FP, 1, [(i, 0, entry(i)) for i in range(10)])
        with pytest.raises(BudgetExceeded, match=r"namespace 'a' uses \d+ of its \d+ byte budget"):
            s.put(a, FP, 1, [(10, 0, entry(10))])
        s.put(b, FP, 1, [(i, 0, entry(i)) for i in range(5)])
        with pytest.raises(BudgetExceeded, match="the daemon uses"):
            s.put(b, FP, 2, [(0, 0, entry(0))])
        assert s.get(a, FP, 1, [(9, 0)]) == [entry(9)]  # reads keep working
        assert s.drop(a) == (10, 10 * one)
        assert s.used_bytes(a) == 0
        s.put(a, FP, 1, [(i, 0, entry(i)) for i in range(10)])
    finally:
        s.close()


def test_drop_narrowed_by_fingerprint_and_depth(store):
    ns = store.open_namespace("n").id
    other = b"G" * 16
    for fp in (FP, other):
        for depth in (1, 2):
            store.put(ns, fp, depth, [(i, 0, entry(i)) for i in range(3)])
    assert store.drop(ns, FP, 1)[0] == 3
    assert store.get(ns, FP, 1, [(0, 0)]) == [None]
    assert store.get(ns, FP, 2, [(0, 0)]) == [entry(0)]
    assert store.drop(ns, other)[0] == 6
    assert [(g.fingerprint, g.depth) for g in store.groups()] == [(FP, 2)]


def test_entries_and_usage_survive_restart(tmp_path):
    config = StoreConfig(dir=tmp_path)
    s = Store(config)
    ns = s.open_namespace("persist").id
    s.put(ns, FP, 4, [(i, 2, entry(i)) for i in range(20)])
    used = s.used_bytes()
    s.close()
    s = Store(config)
    try:
        assert s.open_namespace("persist", create=False).id == ns
        assert s.used_bytes() == used
        assert s.get(ns, FP, 4, [(7, 2)]) == [entry(7)]
    finally:
        s.close()


def test_errors_name_the_problem(store):
    with pytest.raises(NamespaceNotFound, match="does not exist"):
        store.open_namespace("nope", create=False)
    with pytest.raises(InvalidRequest, match="invalid"):
        store.open_namespace("bad name!")
    with pytest.raises(NamespaceNotFound, match="namespace id 42"):
        store.get(42, FP, 0, [(0, 0)])
    ns = store.open_namespace("x").id
    bad = bytearray(entry(1))
    bad[-1] ^= 1
    with pytest.raises(InvalidRequest, match=r"sample 5 variant 0: entry checksum \(xxh3\) mismatch"):
        store.put(ns, FP, 0, [(4, 0, entry(4)), (5, 0, bytes(bad))])
    assert store.get(ns, FP, 0, [(4, 0)]) == [None]  # the whole call was rejected
    sparse = np.maximum(np.random.default_rng(0).standard_normal(4096, dtype=np.float32), 0)
    encoded = encode_entry([TensorSpec(DType.float32, sparse.shape)], [sparse], zstd_level=1)
    served = b"".join(bytes(p) for p in to_raw_entry(encoded))
    with pytest.raises(InvalidRequest, match="sample 6 variant 0: a raw_verified entry carries no payload checksum"):
        store.put(ns, FP, 0, [(6, 0, served)])


@pytest.mark.parametrize("damage", [100, 6])  # a payload byte; the checksum id, to the unused id 1
def test_corrupt_entry_is_deleted_on_read(tmp_path, damage):
    config = StoreConfig(dir=tmp_path, encoding="raw")
    s = Store(config)
    ns = s.open_namespace("c").id
    s.put(ns, FP, 0, [(i, 0, entry(i)) for i in range(3)])
    s.close()
    env = lmdb.open(str(tmp_path), max_dbs=8)
    db = env.open_db(b"entries")
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(encode_key(ns, FP, 0, 1)))
        value[damage] = 1 if damage == 6 else value[damage] ^ 0xFF
        txn.put(encode_key(ns, FP, 0, 1), bytes(value))
    env.close()
    s = Store(config)
    try:
        with pytest.raises(EntryCorrupt, match=r"sample ids \[1\]"):
            s.get(ns, FP, 0, [(0, 0), (1, 0)])
        assert s.get(ns, FP, 0, [(0, 0), (1, 0)]) == [entry(0), None]
        assert s.groups()[0].entries == 2
    finally:
        s.close()


def test_foreign_file_is_refused(tmp_path):
    (tmp_path / "data.mdb").write_bytes(b"not an lmdb file" * 1000)
    with pytest.raises(StoreError, match="not a valid LMDB file.*--on-corrupt move-aside"):
        Store(StoreConfig(dir=tmp_path))


def test_lmdb_of_another_program_is_refused_untouched(tmp_path):
    env = lmdb.open(str(tmp_path))
    with env.begin(write=True) as txn:
        txn.put(b"user:1", b"alice")
    env.close()
    before = (tmp_path / "data.mdb").read_bytes()
    with pytest.raises(StoreError, match=r"LMDB database of another program .*b'user:1'"):
        Store(StoreConfig(dir=tmp_path))
    assert (tmp_path / "data.mdb").read_bytes() == before


def test_move_aside_keeps_the_bad_file_and_starts_empty(tmp_path):
    garbage = b"not an lmdb file" * 1000
    (tmp_path / "data.mdb").write_bytes(garbage)
    s = Store(StoreConfig(dir=tmp_path, on_corrupt="move-aside"))
    try:
        assert s.namespaces() == []
        ns = s.open_namespace("fresh").id
        s.put(ns, FP, 0, [(1, 0, entry(1))])
        assert s.get(ns, FP, 0, [(1, 0)]) == [entry(1)]
    finally:
        s.close()
    [kept] = tmp_path.glob("data.mdb.corrupt-*")
    assert kept.read_bytes() == garbage


def _break_leaf_page_holding(path, key: bytes) -> None:
    """Clear the page flags of every leaf page holding ``key`` in its nodes (an older copy of its leaf
    may sit in a free page). Stale bytes of the key in the unused middle of a page that another tree
    reused are left alone: breaking that page would break the other tree, which the store reads at
    open."""
    data = bytearray((path / "data.mdb").read_bytes())
    pages = set()
    for m in re.finditer(re.escape(key), data):
        page, at = divmod(m.start(), 4096)
        flags, _, upper = struct.unpack_from("<HHH", data, page * 4096 + 10)  # mp_flags, mp_lower, mp_upper
        if flags & 0x02 and at >= upper:  # P_LEAF, and in the nodes (from mp_upper to the page's end)
            pages.add(page)
    assert pages and min(pages) > 1, f"key found in pages {sorted(pages)} of {len(data) // 4096}"
    for page in pages:
        data[page * 4096 + 10 : page * 4096 + 12] = b"\0\0"  # mp_flags: no longer a leaf page
    (path / "data.mdb").write_bytes(bytes(data))


def test_damaged_btree_is_marked_then_refused_or_moved_aside(tmp_path):
    config = StoreConfig(dir=tmp_path)
    s = Store(config)
    ns = s.open_namespace("d").id
    s.put(ns, FP, 0, [(i, 0, entry(i)) for i in range(3)])
    s.close()
    _break_leaf_page_holding(tmp_path, encode_key(ns, FP, 0, 1))
    s = Store(config)  # LMDB opens it: the damage is inside the tree
    try:
        with pytest.raises(StoreError, match="is damaged .*--on-corrupt move-aside"):
            s.get(ns, FP, 0, [(1, 0)])
    finally:
        s.close()
    with pytest.raises(StoreError, match="marked damaged by an earlier run: .* a read failed"):
        Store(config)
    s = Store(StoreConfig(dir=tmp_path, on_corrupt="move-aside"))
    try:
        assert s.namespaces() == []
    finally:
        s.close()
    assert sorted(p.name.split(".corrupt-")[0] for p in tmp_path.glob("*.corrupt-*")) == [
        "actcache.damaged", "data.mdb", "lock.mdb"]


_GROWTH_FAILS = r"""
import resource, sys
import psutil
from actcache.daemon.config import StoreConfig
from actcache.daemon.store import Store
from actcache.errors import BudgetExceeded
from tests.daemon.test_store import FP, entry

value = entry(0, 256 << 10)
s = Store(StoreConfig(dir=sys.argv[1], map_size_bytes=1 << 20, encoding="raw"))
ns = s.open_namespace("grow").id
for start in range(0, 160, 16):  # 40 MiB: the map grows to 64 MiB
    s.put(ns, FP, 1, [(i, 0, value) for i in range(start, start + 16)])
before = s.map_size()
assert before == 64 << 20, before
vms = psutil.Process().memory_info().vms
resource.setrlimit(resource.RLIMIT_AS, (vms + (40 << 20), resource.RLIM_INFINITY))  # growing needs 64 MiB more
refused = 0
for start in range(160, 400, 16):
    try:
        s.put(ns, FP, 1, [(i, 0, value) for i in range(start, start + 16)])
    except BudgetExceeded as exc:
        assert "cannot grow to" in str(exc) and "ulimit -v" in str(exc), exc
        refused += 1
assert refused and s.map_size() == before, (refused, s.map_size(), before)
assert s.get(ns, FP, 1, [(7, 0)]) == [value]  # the environment is intact
s.drop(ns)
s.put(ns, FP, 1, [(i, 0, value) for i in range(16)])  # freed pages, no growth needed
s.close()
print("refused", refused)
"""


@pytest.mark.slow
def test_map_that_cannot_grow_is_resource_exhausted_not_a_crash(tmp_path):
    """The map's remap is refused (address-space limit, as a huge map on a small machine): puts get
    BudgetExceeded, the environment stays usable, and a drop makes room again."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _GROWTH_FAILS, str(tmp_path)], capture_output=True, text=True,
                         env=env, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("refused ")


def test_drop_runs_in_chunks_with_exact_usage(store, monkeypatch):
    monkeypatch.setattr("actcache.daemon.store._ops._DROP_CHUNK_ENTRIES", 3)
    ns = store.open_namespace("chunks").id
    for depth in (1, 2):
        store.put(ns, FP, depth, [(i, 0, entry(i)) for i in range(10)])
    assert store.drop(ns, FP, 1) == (10, 10 * len(entry(0)))
    assert store.get(ns, FP, 1, [(i, 0) for i in range(10)]) == [None] * 10
    assert [(g.depth, g.entries) for g in store.groups()] == [(2, 10)]
    assert store.used_bytes(ns) == 10 * len(entry(0))


def test_a_key_listed_twice_in_one_put_is_counted_once(store):
    ns = store.open_namespace("dup").id
    result = store.put(ns, FP, 1, [(1, 0, entry(1)), (2, 0, entry(2)), (1, 0, entry(3, 5000))])
    assert (result.entries, result.replaced) == (3, 1)
    assert store.get(ns, FP, 1, [(1, 0)]) == [entry(3, 5000)]
    assert [(g.entries, g.bytes) for g in store.groups()] == [(2, len(entry(2)) + len(entry(3, 5000)))]


def _gen(ns: int, fp: bytes) -> bytes:
    return ns.to_bytes(4, "big") + fp


def test_a_put_over_the_budget_reclaims_dead_generations_oldest_written_first(tmp_path):
    one = len(entry(0))
    s = Store(StoreConfig(dir=tmp_path, budget_bytes=10 * one, encoding="raw", reclaim_after_s=0))
    try:
        ns = s.open_namespace("gens").id
        old, mid, new = b"1" * 16, b"2" * 16, b"3" * 16
        s.put(ns, old, 1, [(i, 0, entry(i)) for i in range(3)])
        s.put(ns, old, 2, [(i, 0, entry(i)) for i in range(1)])  # one generation, two depths
        s.put(ns, mid, 1, [(i, 0, entry(i)) for i in range(4)])
        s.put(ns, new, 1, [(i, 0, entry(i)) for i in range(2)])  # fits: 10 of 10
        s.put(ns, new, 1, [(i, 0, entry(i)) for i in range(2, 5)])  # 3 more: the oldest generation goes, whole
        assert sorted({g.fingerprint for g in s.groups()}) == [mid, new]
        assert s.used_bytes() == 9 * one
        assert (s.generations.reclaimed_generations, s.generations.reclaimed_bytes) == (1, 4 * one)
        assert s.generations.last_write(_gen(ns, old)) is None  # its bookkeeping went with it
        s.put(ns, new, 1, [(i, 0, entry(i)) for i in range(5, 10)])  # 5 more: `mid` goes too
        assert {g.fingerprint for g in s.groups()} == {new} and s.used_bytes() == 10 * one
        # Its own generation is never reclaimed: now the put is refused, saying what was reclaimable.
        with pytest.raises(BudgetExceeded, match=r"dead generations \(no live schedule\) hold 0 bytes .* not enough"):
            s.put(ns, new, 1, [(10, 0, entry(10))])
    finally:
        s.close()


def test_scheduled_and_recent_generations_are_not_reclaimed(tmp_path):
    one = len(entry(0))
    s = Store(StoreConfig(dir=tmp_path, budget_bytes=6 * one, encoding="raw", reclaim_after_s=0))
    try:
        ns = s.open_namespace("pinned").id
        a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
        s.put(ns, a, 1, [(i, 0, entry(i)) for i in range(3)])
        s.put(ns, b, 1, [(i, 0, entry(i)) for i in range(3)])
        s.generations.pin(_gen(ns, a))  # a live schedule reads the oldest
        s.put(ns, c, 1, [(0, 0, entry(0))])
        assert sorted({g.fingerprint for g in s.groups()}) == [a, c]
        with pytest.raises(BudgetExceeded, match=rf"hold {one} bytes .* that could be reclaimed, not enough"):
            s.put(ns, b"d" * 16, 1, [(i, 0, entry(i)) for i in range(4)])  # c (1 entry) is not enough
        assert sorted({g.fingerprint for g in s.groups()}) == [a, c]  # nothing reclaimed for a refused put
    finally:
        s.close()
    s = Store(StoreConfig(dir=tmp_path, budget_bytes=6 * one, encoding="raw", reclaim_after_s=3600))
    try:
        with pytest.raises(BudgetExceeded, match=r"unused for 3600 s \(--reclaim-after\)\) hold 0 bytes"):
            s.put(ns, b"d" * 16, 1, [(i, 0, entry(i)) for i in range(4)])  # just restarted: nothing is dead yet
    finally:
        s.close()


def test_a_namespace_over_its_budget_reclaims_only_its_own_generations(tmp_path):
    one = len(entry(0))
    s = Store(StoreConfig(dir=tmp_path, namespace_budget_bytes=4 * one, encoding="raw", reclaim_after_s=0))
    try:
        x, y = s.open_namespace("x").id, s.open_namespace("y").id
        s.put(y, FP, 1, [(i, 0, entry(i)) for i in range(4)])  # older, and dead, but another namespace's
        s.put(x, b"o" * 16, 1, [(i, 0, entry(i)) for i in range(2)])
        s.put(x, b"n" * 16, 1, [(i, 0, entry(i)) for i in range(3)])
        assert s.used_bytes(y) == 4 * one and s.used_bytes(x) == 3 * one
        assert [g.fingerprint for g in s.groups() if g.namespace_id == x] == [b"n" * 16]
    finally:
        s.close()


def test_last_writes_survive_a_restart_and_a_drop_removes_them(tmp_path):
    config = StoreConfig(dir=tmp_path)
    s = Store(config)
    ns = s.open_namespace("times").id
    s.put(ns, FP, 1, [(0, 0, entry(0))])
    s.put(ns, b"G" * 16, 1, [(0, 0, entry(0))])
    written = s.generations.last_write(_gen(ns, FP))
    s.get(ns, FP, 1, [(0, 0)])
    assert written is not None and s.generations.snapshot({_gen(ns, FP): 1})[0].last_read is not None
    s.close()
    s = Store(config)
    try:
        [stats] = [g for g in s.generation_stats() if g.fingerprint == FP]
        assert (stats.last_write, stats.last_read, stats.dead) == (written, None, False)
        s.drop(ns, FP, 2)  # another depth: the generation keeps its entries and its time
        assert s.generations.last_write(_gen(ns, FP)) == written
        s.drop(ns, FP)
        assert s.generations.last_write(_gen(ns, FP)) is None
        s.drop(ns)
        assert s.generations.known() == []
    finally:
        s.close()
    s = Store(config)
    try:
        assert s.generations.known() == []
    finally:
        s.close()


def test_a_thread_reading_reads_again_while_a_map_resize_waits_for_it():
    """A prefetch reader probes ahead (a second read) with its own transaction open; a resize queued
    between the two used to wait for the reader while the reader waited for the resize."""
    from actcache.daemon.store._writer import ReadGate
    from actcache.testing import wait_until

    gate, steps = ReadGate(), []

    def reader():
        with gate.reading():
            steps.append("read")
            wait_until(lambda: gate._exclusive, timeout=10, what="the resize waiting")
            with gate.reading():  # the probe
                steps.append("read again")
        steps.append("closed")

    def resize():
        wait_until(lambda: "read" in steps, timeout=10, what="the first read")
        with gate.exclusive():
            steps.append("resized")

    threads = [threading.Thread(target=reader, daemon=True), threading.Thread(target=resize, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert steps == ["read", "read again", "closed", "resized"]
