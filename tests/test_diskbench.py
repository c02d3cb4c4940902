"""actcache bench disk: every phase it runs reports a positive rate, and it leaves nothing behind."""

import errno
import json
import os
import subprocess
import sys

import pytest

from actcache.errors import ConfigError
from actcache.ops import diskbench

DISK_PHASES = ["write_sequential", "write_random", "read_sequential", "read_random"]
LMDB_PHASES = ["lmdb_put", "lmdb_get_random_cold", "lmdb_get_random_warm"]


def test_cli_json_has_a_positive_rate_for_every_phase_and_cleans_up(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "actcache", "bench", "disk", "--dir", str(tmp_path), "--size", "8MiB", "--json",
         "--no-drop-caches"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    names = [p["name"] for p in report["phases"]]
    assert set(LMDB_PHASES) <= set(names)
    assert {"read_sequential_buffered_cold", "read_random_buffered_cold",
            "read_sequential_buffered_warm", "read_random_buffered_warm"} <= set(names)
    if report["o_direct"]:
        assert {f"{n}_direct" for n in DISK_PHASES} <= set(names)
    for phase in report["phases"]:
        assert phase["bytes"] == 8 << 20 and phase["seconds"] > 0 and phase["mb_per_s"] > 0, phase
    assert report["size_bytes"] == 8 << 20 and report["block_bytes"] == 1 << 20
    assert report["lmdb_cold_vs_disk"] > 0 and report["verdict"].startswith("LMDB cold get is ")
    assert report["page_cache_dropped"] is False and "--no-drop-caches" in report["cold_method"]
    assert list(tmp_path.iterdir()) == []


def test_table_has_units_and_a_verdict(tmp_path):
    report = diskbench.run_disk_bench(tmp_path, 4 << 20, drop_caches=False)
    table = report.table()
    assert "MB/s" in table and "MiB" in table and "seconds" in table
    assert table.splitlines()[-1] == f"verdict: {report.verdict}"
    assert report.filesystem["type"] != ""
    assert list(tmp_path.iterdir()) == []


def test_o_direct_refused_falls_back_with_a_note(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("O_DIRECT does not exist on this platform")
    real_open = os.open

    def open_refusing_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs answers on older kernels
        return real_open(path, flags, *args)

    monkeypatch.setattr(diskbench.os, "open", open_refusing_direct)
    report = diskbench.run_disk_bench(tmp_path, 4 << 20, drop_caches=False)
    assert not report.o_direct
    assert any("O_DIRECT refused" in n and "Invalid argument" in n for n in report.notes)
    assert not any(p.access == "O_DIRECT" for p in report.phases)
    assert {"write_sequential_buffered", "write_random_buffered"} <= {p.name for p in report.phases}
    assert "buffered cold random read" in report.verdict
    assert all(p.mb_per_s > 0 for p in report.phases)


def test_sizes_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="at least 4 MiB"):
        diskbench.run_disk_bench(tmp_path, 1 << 20)
    with pytest.raises(ConfigError, match="pass a smaller --size"):
        diskbench.run_disk_bench(tmp_path, 1 << 60)
    with pytest.raises(ConfigError, match="is not a directory"):
        diskbench.run_disk_bench(tmp_path / "nope", 8 << 20)
    assert list(tmp_path.iterdir()) == []
