"""The demo's training function on a tiny size, with the embedded daemon the demo uses."""

import importlib.util

import pytest

import actcache_client as ac

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                       reason="scikit-learn not installed (the demo extra: pip install -e '.[demo]')"),
]


def test_demo_runs_report_real_numbers(monkeypatch):
    import demo
    from workloads.tasks import digits

    monkeypatch.delenv("ACTCACHE_SOCKET", raising=False)
    workload = digits(epochs=3, limit=60, blocks=1, batch_size=16)
    assert len(workload.train_set) == 48 and workload.static_depth == 3
    workload.static_at_epoch = 1  # epoch 1 stores the prefix outputs, epoch 2 reads them back
    with ac.connect(namespace="demo-test", embedded=True) as conn:  # a private daemon, as in the demo
        results = demo.run_demo(workload, conn, list(demo.RUNS), progress=False)
    full, cached, frozen = results["full"], results["freeze+cache"], results["freeze only"]
    for r in results.values():
        assert r.steps == 9 and 0 < r.train_s <= r.wall_s and 0 <= r.final_metric <= 100
        assert r.split_s["backward"] > 0 and r.split_s["suffix_forward"] > 0
    assert cached.cache_stats["hits"] == 48 and cached.cache_stats["puts"] == 48
    assert cached.cache_stats["hit_ratio"] == 0.5 and cached.cache_stats["streamed"] == 96
    assert cached.cache_stats["bytes_read"] > 0
    assert full.cache_stats["hits"] == frozen.cache_stats["hits"] == 0
    assert full.split_s["prefix"] == 0 < frozen.split_s["prefix"]
    assert cached.final_metric == frozen.final_metric  # the cache changes the time, not the computation
    text = demo.table(results)
    assert "freeze+cache" in text and "50%" in text and "48/96" in text


def test_the_demo_says_why_it_freezes_by_hand():
    import demo
    from workloads.tasks import digits

    short = demo.why_hand_set(digits(epochs=10))  # the demo's default length
    assert "would not freeze here: a run of 230 steps is too short" in short
    assert "did not pay on digits" in demo.why_hand_set(digits(epochs=80))  # long enough to freeze, and measured
