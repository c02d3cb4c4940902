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
    figures = {k: float(v) for k, v in re.findall(r"^figure: (\w+) = (-?[\d.]+)$", out.stdout, re.M)}
    assert set(figures) == {"variants_overhead", "variants_vs_plain_loader", "seeding_share", "fill_overhead",
                            "train_vs_hand"}, out.stdout
    # ratios of seconds; seeding_share is a difference of two timings over an epoch: about 0 on 192 images
    assert all(v > 0 for k, v in figures.items() if k != "seeding_share"), out.stdout
    assert -1 < figures["seeding_share"] < 1, out.stdout
    assert re.search(r"^loaded epoch, cache.wrap\(loader, variants=2\) +[\d.]+ s \(min\) +[\d.]+ s \(median\) +[\d.]+x$",
                     out.stdout, re.M)
    # CPU seconds in clock ticks: a tiny epoch's may round to 0
    assert re.search(r"^  the daemon storing its entries \(CPU\) +[\d.]+ s \(mean\)$", out.stdout, re.M), out.stdout
