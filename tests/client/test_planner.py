import math
import time
from types import SimpleNamespace

import pytest

from actcache.entries import EntryBatch
from actcache.errors import ConfigError
from actcache_client.cost_model import PlanMode
from actcache_client.engine._codec_choice import EncodingChoice
from actcache_client.engine._planner import CachePlanner, PlannerConfig
from actcache_client.transport import _connection
from actcache_client.transport._connection import Connection, ConnectionConfig


def measured(planner: CachePlanner, k: int, stage_s: float = 1e-3, entry: float = 32e3) -> None:
    for _ in range(5):
        for stage in range(k):
            planner.record_stage(stage, stage_s * 16, 16, entry)
        planner.record_suffix(0.02, 16)


def test_no_plan_until_every_prefix_stage_was_timed():
    planner = CachePlanner(PlannerConfig(total_epochs=10))
    planner.record_stage(0, 0.01, 16, 1000)
    assert planner.measurements(2) is None and planner.plan_for(2) is None
    planner.record_stage(1, 0.01, 16, 1000)
    assert planner.measurements(2).stage_forward_s_per_sample == (0.01 / 16, 0.01 / 16)


def test_plans_follow_measured_fetch_throughput_and_drift_triggers_replan():
    planner = CachePlanner(PlannerConfig(total_epochs=10))
    seen = []
    planner.listeners.append(lambda k, plan: seen.append(plan.mode))
    planner.begin_epoch(0, 1024, 16)
    measured(planner, 3)
    assert planner.plan_for(3).mode is PlanMode.CACHE  # the 1 GB/s prior makes 32 kB entries cheap
    assert not planner.needs_replan(3)
    for _ in range(20):
        planner.record_fetch(32_000 * 16, 16 * 32_000 / 1e5)  # measured: 0.1 MB/s, a crawl
    assert planner.needs_replan(3)
    crawl = planner.plan_for(3)
    assert crawl.mode is PlanMode.RECOMPUTE and "recompute" in crawl.reason
    assert seen == [PlanMode.CACHE, PlanMode.RECOMPUTE]


def test_last_epoch_writes_nothing():
    planner = CachePlanner(PlannerConfig(total_epochs=5))
    measured(planner, 2, stage_s=1e-2)
    planner.begin_epoch(4, 1024, 16)
    assert planner.plan_for(2).mode is PlanMode.RECOMPUTE


def test_budget_limits_the_cached_fraction():
    planner = CachePlanner(PlannerConfig(total_epochs=10, budget_bytes=0.3 * 1000 * 32e3))
    measured(planner, 2, stage_s=1e-2)
    planner.begin_epoch(0, 1000, 16)
    plan = planner.plan_for(2)
    assert plan.mode is PlanMode.CACHE and math.isclose(plan.cached_fraction, 0.3, rel_tol=1e-6)


def test_config_is_validated():
    with pytest.raises(ConfigError, match="total_epochs"):
        PlannerConfig(total_epochs=0)


def test_a_slow_host_to_device_copy_counts_against_caching():
    planner = CachePlanner(PlannerConfig(total_epochs=10))
    planner.begin_epoch(0, 1024, 16)
    measured(planner, 3)
    assert planner.measurements(3).h2d_bytes_per_s is None  # no CUDA copy measured: no copy time
    assert planner.plan_for(3).mode is PlanMode.CACHE
    for _ in range(20):
        planner.record_h2d(32_000 * 16, 16 * 32_000 / 1e5)  # 0.1 MB/s copies
    assert planner.measurements(3).h2d_bytes_per_s == pytest.approx(1e5)
    assert planner.needs_replan(3) and planner.plan_for(3).mode is PlanMode.RECOMPUTE


def test_the_codec_chosen_for_the_cache_depth_is_recorded_in_the_plan():
    planner = CachePlanner(PlannerConfig(total_epochs=10))
    planner.begin_epoch(0, 1024, 16)
    measured(planner, 3)
    assert planner.plan_for(3).encoding is None  # nothing written yet
    planner.record_encoding(2, EncodingChoice("zstd", "another depth", {}))
    assert planner.current.encoding is None
    planner.record_encoding(3, EncodingChoice("lz4", "lz4 serves fastest", {}))
    assert planner.current.cache_depth == 3 and planner.current.encoding == "lz4"
    assert planner.plan_for(3).encoding == "lz4"  # kept by the next plan


def test_a_slow_stream_is_timed_by_its_arrivals_and_the_planner_recomputes(tmp_path, monkeypatch):
    """A stream read at 1 MB/s, frames of 64 entries of 32 KiB (one every 2.1 s), as a step that
    computes 0.3 ms/sample of prefix and 1.05 ms/sample of the rest sees it: the first frames were
    read ahead and are there when asked; then the step waits for each frame most of that time."""
    frame = EntryBatch(0, list(range(64)), [], [memoryview(bytes(32 << 10))] * 64)
    period, step = 64 * (32 << 10) / 1e6, 0.09
    clock, t = [], 0.0  # per frame: when the step asks for it, when it arrives
    for i in range(12):
        wait = 1e-3 if i < 4 else period - step
        clock += [t, t + wait]
        t += wait + step
    ticks = iter([*clock, t])  # and when it asks for a 13th: the stream has ended
    monkeypatch.setattr(_connection, "time", SimpleNamespace(perf_counter=lambda: next(ticks), monotonic=time.monotonic))
    conn = Connection(ConnectionConfig(socket=str(tmp_path / "none.sock")))
    conn._rpc.fetch_batches = lambda *args, **kwargs: iter([frame] * 12)
    conn._namespace_id = 1  # no daemon: the stream's frames come from the list above
    try:
        assert len(list(conn.stream("epoch"))) == 12
    finally:
        conn.close()
    s = conn.stats
    assert s.timed_bytes == 7 * 64 * (32 << 10)  # from the second frame waited for on
    assert s.timed_bytes / s.timed_seconds == pytest.approx(1e6)
    assert s.bytes_read / s.fetch_seconds > 1.5e6  # the waits alone would claim a faster stream

    planner = CachePlanner(PlannerConfig(total_epochs=10))
    planner.begin_epoch(1, 512, 64)
    for _ in range(5):
        for stage in range(5):
            planner.record_stage(stage, 0.06e-3 * 64, 64, 32 << 10)
        planner.record_suffix(1.05e-3 * 64, 64)
    planner.record_fetch(s.timed_bytes, s.timed_seconds)
    plan = planner.plan_for(5)
    assert plan.mode is PlanMode.RECOMPUTE, plan.reason


def test_mid_epoch_the_cached_fraction_is_kept_until_the_next_epoch():
    """Fetch-bound: the plan caches the share where the fetch keeps up with the step. A re-plan
    within the epoch keeps that share (a new one would re-push the stream); the next epoch's takes it."""
    planner = CachePlanner(PlannerConfig(total_epochs=10))
    planner.begin_epoch(1, 512, 64)
    measured(planner, 3)
    for _ in range(20):
        planner.record_fetch(32_000 * 16, 16 * 32_000 / 8e6)  # 8 MB/s
    first = planner.plan_for(3)
    assert first.mode is PlanMode.CACHE and first.cached_fraction < 1
    for _ in range(20):
        planner.record_fetch(32_000 * 16, 16 * 32_000 / 4e6)  # 4 MB/s: a smaller share keeps up
    assert planner.needs_replan(3)
    assert planner.plan_for(3).cached_fraction == first.cached_fraction
    assert not planner.needs_replan(3)
    planner.begin_epoch(2, 512, 64)
    later = planner.plan_for(3)
    assert later.mode is PlanMode.CACHE and later.cached_fraction < 0.7 * first.cached_fraction


def _stepped(planner: CachePlanner, k: int, served_s: float, recomputed_s: float | None) -> None:
    for _ in range(5):
        planner.record_step(served_s * 16, 16, "served", k)
        if recomputed_s is not None:
            planner.record_step(recomputed_s * 16, 16, "recomputed", k)


def test_served_steps_measured_slower_than_the_model_said_turn_the_plan_to_recompute():
    """The model expects caching to win (a slow prefix); the served epoch measured slower than recomputing
    is predicted to be: the next epoch recomputes, and the log line gives both step times."""
    planner = CachePlanner(PlannerConfig(total_epochs=10))
    planner.begin_epoch(1, 1024, 16)
    measured(planner, 3, stage_s=1e-3)  # prefix 3 ms + suffix 1.25 ms per sample
    assert planner.plan_for(3).mode is PlanMode.CACHE
    _stepped(planner, 3, served_s=5e-3, recomputed_s=None)  # slower than the 4.25 ms predicted
    planner.begin_epoch(2, 1024, 16)
    planner.check_measured(3)
    plan = planner.plan_for(3)
    assert plan.mode is PlanMode.RECOMPUTE and plan.cache_depth is None
    assert "measured 80 ms per step served from the cache vs 68 ms recomputing (predicted)" in plan.reason
    # measured recomputing turned out slower still: the cache comes back, and stays through re-plans
    _stepped(planner, 3, served_s=5e-3, recomputed_s=6e-3)
    planner.check_measured(3)
    for _ in range(3):
        plan = planner.plan_for(3)
        assert plan.mode is PlanMode.CACHE and plan.cache_depth == 3 and plan.cached_fraction == 1.0
    assert "96 ms recomputing (measured)" in plan.reason


def test_the_measured_check_needs_served_steps():
    planner = CachePlanner(PlannerConfig(total_epochs=10))
    planner.begin_epoch(1, 1024, 16)
    measured(planner, 3)
    planner.record_step(1.0, 16, "served", 3)  # one step is no measurement
    planner.check_measured(3)
    assert planner.plan_for(3).mode is PlanMode.CACHE


def test_the_fetch_speed_is_never_taken_below_the_rate_the_step_received():
    planner = CachePlanner(PlannerConfig(total_epochs=10, prior_fetch_bytes_per_s=1e6))
    measured(planner, 2)
    stats = _connection.ClientStats(received_bytes=int(900e6), received_seconds=1.0)
    planner.observe(stats)
    assert planner.measurements(2).fetch_bytes_per_s == pytest.approx(900e6)


def test_once_the_stream_serves_the_write_epochs_probe_no_longer_times_the_fetch():
    """A Get probe of a few small entries is latency-bound; the stream's first frames replace it."""
    planner = CachePlanner(PlannerConfig(total_epochs=10, prior_fetch_bytes_per_s=2e9))
    measured(planner, 2)
    planner.observe(_connection.ClientStats(timed_bytes=1 << 20, timed_seconds=0.01))  # the probe: 105 MB/s
    assert planner.measurements(2).fetch_bytes_per_s == pytest.approx((1 << 20) / 0.01)
    frames = _connection.ClientStats(timed_bytes=1 << 20, timed_seconds=0.01, received_bytes=int(200e6),
                                     received_seconds=1.0)  # a stream that kept up with a 200 MB/s step
    planner.observe(frames)
    assert planner.has_fetch_rate()  # measured: no further probes
    assert planner.measurements(2).fetch_bytes_per_s == pytest.approx(2e9)  # the prior, above the floor


def test_frames_the_step_waited_for_cap_the_prior_fetch_speed():
    planner = CachePlanner(PlannerConfig(total_epochs=10, prior_fetch_bytes_per_s=1e9))
    measured(planner, 2)
    stats = _connection.ClientStats(received_bytes=int(20e6), received_seconds=1.0,  # floor: 20 MB/s
                                    waited_bytes=int(30e6), waited_seconds=1.0)  # waited 1 s for 30 MB
    planner.observe(stats)
    assert planner.measurements(2).fetch_bytes_per_s == pytest.approx(30e6)


def test_caching_measured_faster_than_recomputing_caches_every_sample():
    """The model's fetch reading is low, so it would cache a part of each batch; steps served whole were
    measured faster than recomputing: every sample is cached."""
    planner = CachePlanner(PlannerConfig(total_epochs=10, prior_fetch_bytes_per_s=1e9))
    planner.begin_epoch(1, 1024, 16)
    measured(planner, 3, stage_s=1e-3, entry=256e3)
    planner.record_fetch(int(30e6), 1.0)  # 30 MB/s: transfer-bound at a full cache
    modelled = planner.plan_for(3)
    assert modelled.mode is PlanMode.CACHE and modelled.cached_fraction < 1.0
    _stepped(planner, 3, served_s=2e-3, recomputed_s=None)
    planner.begin_epoch(2, 1024, 16)
    planner.check_measured(3)
    plan = planner.plan_for(3)
    assert (plan.mode, plan.cache_depth, plan.cached_fraction) == (PlanMode.CACHE, 3, 1.0)
    assert "cache depth 3 for every sample: measured" in plan.reason


def test_the_run_length_told_weighs_the_write_epoch_and_a_configured_one_is_kept():
    planner = CachePlanner(PlannerConfig())
    planner.begin_epoch(1, 1024, 16)
    measured(planner, 3)
    assert planner.measurements(3).remaining_epochs == 10.0  # assumed
    planner.expect_epochs(4)
    assert planner.measurements(3).remaining_epochs == 3.0
    configured = CachePlanner(PlannerConfig(total_epochs=20))
    configured.expect_epochs(4)
    assert configured.config.total_epochs == 20
