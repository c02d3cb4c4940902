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
