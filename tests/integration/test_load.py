"""A short run of bench/bench_load.py: 4 client processes of mixed put/get/stats, zero errors.

Only correctness is asserted (errors, every hit bit-exact, the daemon's exit);
the timings it prints are figures, not thresholds.
"""

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_load.py"


def test_mixed_load_has_no_errors(tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCH), "--processes", "4", "--seconds", "3", "--entry-kib", "16",
         "--json", str(tmp_path / "load.json")],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "figure: load_errors = 0" in out.stdout
    assert re.search(r"figure: load_p99_ms = [0-9.]+", out.stdout)
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(put|get|stats) +(\d+)", out.stdout, re.M)}
    assert all(counts[op] > 0 for op in ("put", "get", "stats")), out.stdout
