"""bench_guard.py's replay of the accuracy guard on recorded dev-metric curves."""

import json

import bench_guard


def _evals(metrics, frozen):
    return [{"step": 10 * (i + 1), "epoch": (i + 1) / 4, "metric": m, "frozen": f}
            for i, (m, f) in enumerate(zip(metrics, frozen, strict=True))]


def test_the_guard_fires_only_below_the_best_metric_reported_at_a_shallower_depth():
    evals = _evals([80.0, 85.0, 84.5, 83.9, 86.0], [0, 0, 1, 1, 2])
    assert bench_guard.first_firing(evals, tolerance=1.0) == {
        "step": 40, "epoch": 1.0, "metric": 83.9, "reference": 85.0, "frozen": 1}
    assert bench_guard.first_firing(evals, tolerance=1.2) is None
    # the same fall with nothing frozen is never a guard's business
    assert bench_guard.first_firing(_evals([80.0, 85.0, 83.0], [0, 0, 0]), tolerance=0.1) is None


def test_noise_is_the_largest_fall_below_the_best_so_far_from_the_first_freeze_on():
    evals = _evals([80.0, 70.0, 85.0, 84.0, 83.5, 86.0], [0] * 6)
    assert bench_guard.noise_drop(evals, start_step=30) == 1.5
    assert bench_guard.noise_drop(evals, start_step=0) == 10.0


def test_the_script_counts_a_tolerance_useful_only_if_it_separates_losing_runs(tmp_path, capsys, monkeypatch):
    full = {"mode": "full", "cache": False, "workload": "sst2", "final_metric": 87.0,
            "evals": _evals([85.0, 87.0, 86.8, 87.0], [0] * 4)}
    lost = {"mode": "egeria", "cache": True, "workload": "sst2", "final_metric": 85.0,
            "evals": _evals([85.0, 87.0, 85.2, 85.0], [0, 0, 1, 1])}
    kept = {"mode": "egeria", "cache": True, "workload": "sst2", "final_metric": 87.0,
            "evals": _evals([85.0, 87.0, 86.9, 87.0], [0, 0, 1, 1])}
    paths = []
    for seed, run in enumerate((lost, kept)):
        path = tmp_path / f"seed{seed}.json"
        path.write_text(json.dumps({"seed": seed, "runs": [full, run]}))
        paths.append(str(path))
    monkeypatch.setattr("sys.argv", ["bench_guard.py", *paths, "--tolerance", "0.05", "1.0", "2.0"])
    bench_guard.main()
    out = capsys.readouterr().out
    assert "figure: guard_noise_drop = 0.20" in out
    # 0.05 also fires on the run that kept its accuracy; 2.0 misses the loss; 1.0 separates them
    assert "figure: guard_useful_tolerances = 1" in out
