"""Operations on a real daemon: one daemon per directory, `actcache clean`, the metrics endpoint."""

import subprocess
import sys

from actcache.testing import run_daemon


def actcache(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actcache", *args], capture_output=True, text=True, timeout=timeout)


def test_second_daemon_on_the_same_dir_refuses_and_leaves_the_first_alone(tmp_path):
    with run_daemon(cache_dir=tmp_path / "cache") as first:
        for socket in (tmp_path / "other.sock", first.socket):
            refused = actcache("serve", "--dir", str(first.dir), "--socket", str(socket))
            assert refused.returncode == 2, refused.stderr
            assert f"is in use by another actcache daemon (pid {first.pid}" in refused.stderr
            assert "pass a different --dir" in refused.stderr
        assert first.socket.exists()
        with first.client() as c:
            assert c.open("still-serving").namespace_id >= 1


def test_clean_removes_a_stale_socket_and_keeps_a_live_one(tmp_path):
    import json
    import socket

    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    out = actcache("clean", "--socket", str(stale))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"removed  socket        {stale}: stale") and not stale.exists()

    with run_daemon(cache_dir=tmp_path / "cache") as d:
        out = actcache("clean", "--socket", str(d.socket), "--dir", str(d.dir), "--json")
        assert out.returncode == 0, out.stderr
        found = {f["reclaimer"]: f for f in json.loads(out.stdout)}
        assert found["socket"]["action"] == "kept" and d.socket.exists()
        assert found["lmdb readers"]["action"] == "kept" and f"pid {d.pid}" in found["lmdb readers"]["detail"]
        with d.client() as c:
            assert c.open("after-clean").namespace_id >= 1
