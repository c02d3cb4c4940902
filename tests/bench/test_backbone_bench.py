"""bench/bench_backbone.py --quick end to end on the CPU (a subprocess, its own daemon): the figures are
there and are numbers, the cached rows were served, and float32 entries leave the losses bit for bit."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("delivered_vs_raw", "recompute_overhead", "costmodel_vs_best", "served_gb_s", "cached_vs_ideal",
           "losses_equal")

pytest.importorskip("transformers", reason="transformers not installed: the bench builds its BERT from a BertConfig")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("backbone") / "quick.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client"),
                                                        os.environ.get("PYTHONPATH", "")])}
    env.pop("ACTCACHE_SOCKET", None)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_backbone.py"), "--quick", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(out.read_text())


def test_every_figure_is_printed_as_a_number(quick_run):
    stdout, result = quick_run
    printed = dict(re.findall(r"^figure: (\w+) = (\S+)$", stdout, flags=re.M))
    assert sorted(printed) == sorted(FIGURES)
    for name in FIGURES:
        value = float(printed[name])
        assert math.isfinite(value) and value >= 0, (name, value)
        assert result["figures"][name] == pytest.approx(value, abs=1e-3)


def test_the_cached_rows_were_served_and_the_declined_one_was_not(quick_run):
    _, result = quick_run
    rows = result["configs"]["quick"]["rows"]
    assert {"plain", "actcache_default", "actcache_bf16", "actcache_planner", "actcache_off",
            "actcache_all_frozen", "ideal_host"} <= set(rows)
    for name, row in rows.items():
        assert len(row["epoch_s"]) == 5 and 0 < row["best_s"] <= row["median_s"], name
        if name.startswith("actcache_") and name != "actcache_off" and row["plan_mode"] in (None, "cache"):
            assert row["hits"] > 0 and row["gb_s"] > 0, name
    assert rows["actcache_all_frozen"]["hits"] == 5 * 512  # no planner: served from the first timed epoch
    assert rows["actcache_off"]["hits"] == 0 and rows["actcache_off"]["plan_mode"] == "recompute"
    assert result["configs"]["quick"]["raw_lmdb"]["entries"] == 512


def test_float32_entries_leave_the_losses_of_the_plain_loop_bit_for_bit(quick_run):
    _, result = quick_run
    rows = result["configs"]["quick"]["rows"]
    assert result["figures"]["losses_equal"] == 1.0
    assert rows["actcache_default"]["losses"] == rows["plain"]["losses"] and len(rows["plain"]["losses"]) == 7 * 8
