"""A full disk under a real daemon: a size-limited tmpfs holds the cache directory.

Puts get RESOURCE_EXHAUSTED quoting the numbers, reads keep being served,
nothing is corrupted (every acknowledged entry reads back after a restart),
and ``drop`` gives the space back. Needs root to mount the tmpfs; without it
the test is skipped and the map/budget caps (tests/daemon) still run.
"""

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from actcache.codec import DType, TensorSpec, encode_entry
from actcache.errors import BudgetExceeded
from actcache.testing import run_daemon

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

FP = bytes(range(16))
FS_BYTES = 32 << 20
SPEC = [TensorSpec(DType.uint8, (256 << 10,))]


def entry(sample_id: int) -> bytes:
    return encode_entry(SPEC, [np.random.default_rng(sample_id).integers(0, 256, SPEC[0].nbytes, dtype=np.uint8)])


@pytest.fixture
def small_fs():
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    where = Path(tempfile.mkdtemp(prefix="actcache-fullfs-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        shutil.rmtree(where, ignore_errors=True)


def fill(client, ns: int) -> tuple[list[int], BudgetExceeded]:
    """Put 4-entry batches until the daemon refuses; return the acknowledged ids and the refusal."""
    acked: list[int] = []
    for batch in range(4 * FS_BYTES // (1 << 20)):  # bounded: twice what could ever fit
        ids = list(range(batch * 4, batch * 4 + 4))
        try:
            client.put(ns, FP, 1, [(i, 0, entry(i)) for i in ids])
        except BudgetExceeded as exc:
            return acked, exc
        acked += ids
    raise AssertionError(f"{len(acked)} entries fitted on a {FS_BYTES}-byte file system")


def check_all(client, ns: int, ids: list[int]) -> None:
    for start in range(0, len(ids), 16):
        chunk = ids[start : start + 16]
        assert [bytes(v) for v in client.get(ns, FP, 1, chunk)] == [entry(i) for i in chunk]


@pytest.mark.parametrize("map_size", ["1MiB", "1GiB"], ids=["map-grows-into-full-disk", "map-larger-than-disk"])
def test_full_disk_is_resource_exhausted_and_drop_gives_space_back(small_fs, map_size):
    args = ("--encoding", "raw", "--disk-reserve", "0", "--map-size", map_size)
    with run_daemon(*args, cache_dir=small_fs / "cache") as d:
        with d.client(timeout_s=30) as c:
            ns = c.open("full").namespace_id
            acked, refusal = fill(c, ns)
            assert len(acked) >= 40
            message = str(refusal)
            assert re.search(r"the disk holding .* is full: \d+ bytes free of \d+ .*needs about \d+ bytes", message)
            assert "RESOURCE_EXHAUSTED" in message
            check_all(c, ns, acked)  # reads keep being served on the full disk
            assert c.stats().used_bytes > 0
            assert c.drop(ns).entries == len(acked)
            again = list(range(10_000, 10_040))
            for start in range(0, len(again), 4):
                c.put(ns, FP, 1, [(i, 0, entry(i)) for i in again[start : start + 4]])
        d.stop()
        d.start()  # nothing was corrupted by the failed commits
        with d.client(timeout_s=30) as c:
            check_all(c, ns, again)
            assert c.get(ns, FP, 1, acked[:4]) == [None] * 4
            assert c.stats().used_bytes == sum(len(entry(i)) for i in again)


def test_disk_reserve_refuses_puts_before_the_disk_is_full(small_fs):
    reserve = 8 << 20
    with run_daemon("--encoding", "raw", "--disk-reserve", str(reserve), cache_dir=small_fs / "cache") as d:
        with d.client(timeout_s=30) as c:
            ns = c.open("reserve").namespace_id
            acked, refusal = fill(c, ns)
            assert re.search(r"has \d+ bytes free .* needs \d+ bytes while 8388608 bytes .* stay reserved", str(refusal))
            st = os.statvfs(small_fs)
            assert st.f_bavail * st.f_frsize >= reserve - len(entry(0)) * 4
            check_all(c, ns, acked)
            c.drop(ns)
            c.put(ns, FP, 1, [(i, 0, entry(i)) for i in acked[:8]])  # freed pages inside data.mdb count as room
            check_all(c, ns, acked[:8])
