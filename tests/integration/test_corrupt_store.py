"""A damaged or foreign LMDB file: `actcache serve` refuses with a clear message, or moves it aside when asked."""

import subprocess
import sys

import pytest

from actcache.codec import DType, TensorSpec, encode_entry
from actcache.testing import run_daemon

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

FP = bytes(range(16))
ENTRY = encode_entry([TensorSpec(DType.uint8, (64 << 10,))], [bytes(range(256)) * 256])


def serve(cache_dir, tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "actcache", "serve", "--dir", str(cache_dir), "--socket", str(tmp_path / "s.sock"), *args],
        capture_output=True, text=True, timeout=60,
    )


def truncated_store(cache_dir) -> None:
    """A real store whose data.mdb lost its tail (reading it through the map would be a SIGBUS)."""
    with run_daemon(cache_dir=cache_dir) as d, d.client() as c:
        ns = c.open("t").namespace_id
        c.put(ns, FP, 0, [(i, 0, ENTRY) for i in range(20)])
    with open(cache_dir / "data.mdb", "r+b") as f:
        f.truncate(3 * 4096)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_serve_refuses_a_bad_store_and_says_what_to_do(tmp_path, damage):
    cache = tmp_path / "cache"
    cache.mkdir()
    if damage == "garbage":
        (cache / "data.mdb").write_bytes(b"\x00garbage" * 4096)
    else:
        truncated_store(cache)
    out = serve(cache, tmp_path)
    assert out.returncode == 2, out.stderr
    expected = "not a valid LMDB file" if damage == "garbage" else "the file was truncated"
    assert expected in out.stderr
    assert "--on-corrupt move-aside" in out.stderr
    assert (cache / "data.mdb").exists()  # refusing never moves anything


def test_move_aside_starts_empty_and_keeps_the_files(tmp_path):
    cache = tmp_path / "cache"
    truncated_store(cache)
    damaged = (cache / "data.mdb").read_bytes()
    with run_daemon("--on-corrupt", "move-aside", cache_dir=cache) as d:
        assert "moved" in d.log_tail() and ".corrupt-" in d.log_tail()
        with d.client() as c:
            assert list(c.stats().namespaces) == []
            ns = c.open("t").namespace_id
            c.put(ns, FP, 0, [(1, 0, ENTRY)])
            assert c.get(ns, FP, 0, [1])[0] is not None
    [kept] = cache.glob("data.mdb.corrupt-*")
    assert kept.read_bytes() == damaged
