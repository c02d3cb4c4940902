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

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

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
            "data_plane", "ideal_host"} <= set(rows)
    for name, row in rows.items():
        assert len(row["epoch_s"]) == 5 and 0 < row["best_s"] <= row["median_s"], name
        if (name.startswith("actcache_") and name != "actcache_off" and row["plan_mode"] in (None, "cache")) \
                or name == "data_plane":
            assert row["hits"] > 0 and row["gb_s"] > 0, name
    planes = result["configs"]["quick"]["setup"]
    assert planes["plane_kib"] == 256 and rows["data_plane"]["hits"] == 5 * 256  # no planner: every timed epoch
    assert rows["actcache_off"]["hits"] == 0 and rows["actcache_off"]["plan_mode"] == "recompute"
    assert result["configs"]["quick"]["raw_lmdb"]["entries"] == 256


def test_float32_entries_leave_the_losses_of_the_plain_loop_bit_for_bit(quick_run):
    _, result = quick_run
    rows = result["configs"]["quick"]["rows"]
    assert result["figures"]["losses_equal"] == 1.0
    assert rows["actcache_default"]["losses"] == rows["plain"]["losses"] and len(rows["plain"]["losses"]) == 7 * 8


def test_the_figures_compare_the_rows_at_the_configurations_store_dtype():
    import bench_backbone
    import torch

    def row(median, run, gb_s=0.0, losses=(1.0,)):
        return {"median_s": median, "run_s": run, "gb_s": gb_s, "losses": list(losses)}

    setup = bench_backbone.Setup(name="h2048", hidden=8, layers=2, frozen=1, sequences=4, seq_len=4, batch=2,
                                 store_dtype="bfloat16", epochs=2, device=torch.device("cpu"))
    rows = {"plain": row(3.0, 14.0), "actcache_bf16": row(2.0, 12.0, gb_s=6.0), "actcache_planner": row(2.5, 13.0),
            "actcache_off": row(3.09, 14.5), "data_plane": row(1.0, 5.0, gb_s=8.0),
            "ideal_host": row(1.6, 9.0)}
    got = bench_backbone.figures(setup, rows, {"gb_s": 10.0})
    assert got == pytest.approx({"delivered_vs_raw": 0.8, "recompute_overhead": 1.03,
                                 "costmodel_vs_best": 13.0 / 12.0, "served_gb_s": 6.0, "cached_vs_ideal": 1.25})
