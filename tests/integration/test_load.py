"""A short run of bench/bench_load.py: 4 client processes of mixed put/get/stats/Schedule+Fetch, zero errors.

Only correctness is asserted (the bench counts as errors any failed call, a
hit without its tensor, a miss of an id known to be stored, a Fetch whose
entries are not its pushed ids in order or came on the other data plane, a
shared-memory segment left behind); the timings it prints are figures, not
thresholds.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import segments

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_load.py"
FETCH_IDS = 32


def test_mixed_load_with_fetch_has_no_errors(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    out = subprocess.run(
        [sys.executable, str(BENCH), "--processes", "4", "--seconds", "3", "--entry-kib", "16", "--keys", "512",
         "--fetch-ids", str(FETCH_IDS), "--json", str(tmp_path / "load.json")],
        capture_output=True, text=True, timeout=240, env={**os.environ, "ACTCACHE_SHM_DIR": str(shm)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "figure: load_errors = 0" in out.stdout
    assert re.search(r"figure: load_p99_ms = [0-9.]+", out.stdout)
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["errors"] == []
    counts = {row["op"]: row["count"] for row in report["rows"]}
    assert all(counts[op] > 0 for op in ("put", "get", "stats", "schedule", "fetch", "fetch_shm")), out.stdout
    assert counts["schedule"] == counts["fetch"] + counts["fetch_shm"]  # one push per Fetch
    for op in ("fetch", "fetch_shm"):  # every position of every pushed schedule came back; some were hits
        entries = report["entries"][op]
        assert entries["hits"] + entries["misses"] == counts[op] * FETCH_IDS, (op, entries)
        assert entries["hits"] > 0, (op, entries)
    assert segments(shm) == []
