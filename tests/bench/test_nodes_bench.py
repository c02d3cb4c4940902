"""bench/capacity.py and bench/bench_nodes.py on tiny sizes: entry sizes from ResNet-20, the hit model, measured hits."""

import argparse

import pytest

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not


def test_capacity_entries_come_from_resnet20_shapes_and_the_model_is_consistent():
    import capacity

    sizes = {depth: nbytes for depth, _, nbytes, _ in capacity.resnet20_entry_bytes(batch=2)}
    assert sizes[1] == sizes[4] > 16 * 32 * 32 * 4  # 16x32x32 fp32 plus the header
    assert sizes[7] - 32 * 16 * 16 * 4 == sizes[10] - 64 * 8 * 8 * 4 == sizes[1] - 16 * 32 * 32 * 4  # same header
    stable = capacity.plan(1000, 4, 100, 10, epochs=3, node_stable=True)
    glob = capacity.plan(1000, 4, 100, 10, epochs=3, node_stable=False)
    assert stable["cache_bytes"] == 250 * 100 and stable["hit_ratio_mean"] == 1.0 and stable["net_bytes"] == 0
    assert glob["hit_ratio_epoch2"] == pytest.approx(0.25) and glob["hit_ratio_mean"] == pytest.approx((0.25 + 0.4375) / 2)
    assert glob["cache_bytes"] == pytest.approx(1000 * (1 - 0.75**3) * 100)


def test_bench_nodes_cache_run_hits_on_the_node_stable_sampler_only(monkeypatch):
    import bench_nodes

    args = argparse.Namespace(samples=128, epochs=3, nodes=2, ranks=2, batch=8)
    stable = bench_nodes.cache_run("node-stable", args)
    assert stable["worst_rank_hit_ratio"] == 1.0 and stable["entries_per_node"] == [64, 64]
    glob = bench_nodes.cache_run("global", args)
    assert glob["hit_ratio"] < 0.9 and sum(glob["entries_per_node"]) > 128
