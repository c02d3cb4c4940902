"""bench/bench_loader.py on a tiny size: every comparison runs and ends with its figure."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_loader.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                       reason="scikit-learn not installed (the demo extra: pip install -e '.[demo]')"),
]


def test_bench_loader_prints_rows_with_ratios_and_its_figures():
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--repeats", "1", "--epochs", "4", "--limit", "192",
                          "--workers", "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = dict(re.findall(r"^figure: (\w+) = ([\d.]+)$", out.stdout, re.M))
    assert set(figures) == {"variants_overhead", "variants_vs_plain_loader", "seeding_share", "fill_overhead",
                            "train_vs_hand"}, out.stdout
    assert all(float(v) > 0 for v in figures.values())
    assert re.search(r"^loaded epoch, cache.wrap\(loader, variants=2\) +[\d.]+ s \(min\) +[\d.]+ s \(median\) +[\d.]+x$",
                     out.stdout, re.M)
