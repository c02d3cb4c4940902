"""Operations on a real daemon: one daemon per directory, `actcache clean`, the metrics endpoint."""

import json
import re
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actcache.codec import DType, TensorSpec, encode_entry
from actcache.testing import run_daemon

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

FP = bytes(range(16))


def actcache(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actcache", *args], capture_output=True, text=True, timeout=timeout)


def test_second_daemon_on_the_same_dir_refuses_and_leaves_the_first_alone(tmp_path):
    with run_daemon(cache_dir=tmp_path / "cache") as first:
        for sock in (tmp_path / "other.sock", first.socket):
            refused = actcache("serve", "--dir", str(first.dir), "--socket", str(sock))
            assert refused.returncode == 2, refused.stderr
            assert f"is in use by another actcache daemon (pid {first.pid}" in refused.stderr
            assert "pass a different --dir" in refused.stderr
        assert first.socket.exists()
        with first.client() as c:
            assert c.open("still-serving").namespace_id >= 1


def test_clean_removes_a_stale_socket_and_keeps_a_live_one(tmp_path):
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


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample at ``url`` as {(sample name, sorted labels): value}; checks the family types."""
    with urllib.request.urlopen(url, timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name == family.name + "_total", sample.name
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_endpoint_reports_exact_usage_and_counters(tmp_path):
    spec = [TensorSpec(DType.uint8, (1000,))]
    values = [encode_entry(spec, [bytes([i]) * 1000]) for i in range(5)]
    with run_daemon("--metrics-port", "0", "--encoding", "raw", "--budget", "100MB", cache_dir=tmp_path / "c") as d:
        url = re.search(r"metrics (http://127\.0\.0\.1:\d+/metrics)", d.log_path.read_text()).group(1)
        with d.client() as c:
            a = c.open("alpha").namespace_id
            b = c.open("beta").namespace_id
            c.put(a, FP, 1, [(i, 0, v) for i, v in enumerate(values)])
            c.put(b, FP, 2, [(0, 0, values[0])])
            assert sum(v is not None for v in c.get(a, FP, 1, [0, 1, 2, 99])) == 3
            assert c.get(b, FP, 2, [7]) == [None]
            stats = c.stats()
        m = scrape(url)
        size = len(values[0])
        assert m[("actcache_puts_total", ())] == 6
        assert m[("actcache_put_bytes_total", ())] == 6 * size
        assert m[("actcache_gets_total", ())] == 2
        assert m[("actcache_hits_total", ())] == 3
        assert m[("actcache_misses_total", ())] == 2
        assert m[("actcache_served_bytes_total", ())] == 3 * size
        assert m[("actcache_corrupt_total", ())] == 0
        assert m[("actcache_stored_entries", (("namespace", "alpha"),))] == 5
        assert m[("actcache_stored_entries", (("namespace", "beta"),))] == 1
        assert m[("actcache_stored_bytes", (("namespace", "alpha"),))] == 5 * size
        assert m[("actcache_stored_bytes", (("namespace", "beta"),))] == size
        assert m[("actcache_budget_bytes", ())] == 100_000_000
        assert m[("actcache_namespace_budget_bytes", ())] == 0
        assert m[("actcache_map_size_bytes", ())] == stats.map_size_bytes
        assert m[("actcache_file_bytes", ())] == stats.file_bytes
        assert m[("actcache_info", (("version", stats.server_version),))] == 1
        assert m[("actcache_uptime_seconds", ())] > 0
        assert m[("process_resident_memory_bytes", ())] > 0
        assert not [k for k in m if "sample" in str(k)]  # no per-sample labels
        d.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)  # the endpoint goes away with the daemon


def test_metrics_are_off_by_default_and_a_taken_port_is_a_clear_error(tmp_path):
    with run_daemon(cache_dir=tmp_path / "c") as d:
        assert "metrics http" not in d.log_path.read_text()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        out = actcache("serve", "--dir", str(tmp_path / "c2"), "--socket", str(tmp_path / "s.sock"),
                       "--metrics-port", str(port))
    finally:
        taken.close()
    assert out.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr and "--metrics-port" in out.stderr
    assert not (tmp_path / "s.sock").exists()
