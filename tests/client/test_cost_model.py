"""Decision tables for the cost model; every row says why its answer is the right one.

Shared setting unless a row overrides it (see ``measurements``): 32 samples per step,
10 000 samples, 5 epochs left, 1 ms fetch latency per batch (0.03 ms per sample),
writes at 1 GB/s, H2D at 10 GB/s, decode at 5 GB/s, no budget limit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actcache_client import cost_model
from actcache_client.cost_model import Measurements, PlanMode, cached_subset, plan, should_replan

MS = 1e-3


def measurements(**overrides: object) -> Measurements:
    fields = dict(
        stage_forward_s_per_sample=[4 * MS, 4 * MS],
        entry_bytes_per_sample=[150e3, 400e3, 200e3],
        fetch_bytes_per_s=2e9,
        fetch_latency_s=1 * MS,
        write_bytes_per_s=1e9,
        h2d_bytes_per_s=10e9,
        suffix_step_s_per_sample=2 * MS,
        batch_size=32,
        num_samples=10_000,
        remaining_epochs=5.0,
        budget_bytes=math.inf,
        decode_bytes_per_s=5e9,
    )
    fields.update(overrides)
    return Measurements(**fields)


# --- plan: decision table --------------------------------------------------------------

def test_fast_disk_heavy_prefix_caches_at_frozen_depth_worked_example() -> None:
    # 8 ms of prefix per sample vs a 200 KB entry that arrives in 0.1 ms (2 GB/s) + 0.02 ms
    # H2D + 0.03 ms latency share: hidden under the 2 ms suffix, so a read epoch costs
    # 2 ms + 0.04 ms decode instead of 10 ms. Depth 1 would still recompute 4 ms.
    p = plan(2, measurements())
    assert (p.mode, p.cache_depth, p.recompute_stages, p.cached_fraction) == (PlanMode.CACHE, 2, (2, 2), 1.0)
    steady = 2 * MS + 200e3 / 5e9
    write = 200e3 * (1 / 1e9 + 1 / 10e9)  # D2H copy + put, once, in the write epoch
    assert p.numbers["steady_s_per_sample"] == pytest.approx(steady)
    assert p.expected_step_s == pytest.approx(32 * (10 * MS + write + 4 * steady) / 5)
    assert p.baseline_step_s == pytest.approx(32 * 10 * MS)
    assert p.write_epoch_extra_s == pytest.approx(10_000 * write)
    assert "depth 2 of 2" in p.reason and " ms per step" in p.reason and "%" in p.reason


@pytest.mark.parametrize(
    ("prefix_s", "fetch_bytes_per_s", "mode", "why"),
    [
        # 2 MB entries at 50 MB/s take 40 ms, 10x the whole 4 ms step: the disk keeps up with
        # at most c* = 4 / 41 ≈ 10% of samples, each saving 1 ms minus 0.4 ms decode: 1.5% per read
        # epoch, 0.1% once the write epoch is paid < 2% min_gain.
        (1 * MS, 50e6, PlanMode.RECOMPUTE, "slow disk, light prefix"),
        # Same disk, 8 ms prefix: caching the share the disk can feed (c* ≈ 23%) saves
        # 7.6 ms on each of those samples, ~12% overall even after the write epoch.
        (8 * MS, 50e6, PlanMode.CACHE, "slow disk, heavy prefix: disk-limited subset"),
    ],
)
def test_disk_speed_against_prefix_weight(prefix_s: float, fetch_bytes_per_s: float, mode: PlanMode,
                                          why: str) -> None:
    m = measurements(stage_forward_s_per_sample=[prefix_s], entry_bytes_per_sample=[150e3, 2e6],
                     suffix_step_s_per_sample=3 * MS, fetch_bytes_per_s=fetch_bytes_per_s)
    p = plan(1, m)
    assert p.mode is mode, (why, p.reason)
    if mode is PlanMode.CACHE:
        # Unlimited budget, yet not everything is cached: more would make the step wait for the disk,
        # so the share stops where a disk 25% slower than measured would still keep up.
        slower = plan(1, dataclasses.replace(m, fetch_bytes_per_s=fetch_bytes_per_s / 1.25), fetch_margin=0.0)
        assert p.cached_fraction == pytest.approx(slower.numbers["balance_fraction"]) and p.cached_fraction < 0.3
        assert p.numbers["transfer_s_per_sample"] < p.numbers["device_s_per_sample"]
    else:
        assert p.expected_step_s == p.baseline_step_s and "min_gain" in p.reason


def test_budget_for_30_percent_caches_a_30_percent_subset() -> None:
    # The budget holds 0.3 x 10 000 x 200 KB; fetch is far from the bottleneck, so the whole
    # budget is used and the other 70% recompute the 8 ms prefix (AutoFreeze's I < D).
    # Depth 1 entries are 400 KB: the same budget covers only 15% there.
    p = plan(2, measurements(budget_bytes=0.3 * 10_000 * 200e3))
    assert (p.mode, p.cache_depth) == (PlanMode.CACHE, 2)
    assert p.cached_fraction == pytest.approx(0.3, rel=1e-12)
    assert p.numbers["device_s_per_sample"] == pytest.approx(0.3 * 2 * MS + 0.7 * 10 * MS)
    assert p.write_epoch_extra_s == pytest.approx(0.3 * 10_000 * 200e3 * 1.1e-9)
    assert "30.0%" in p.reason


@pytest.mark.parametrize("remaining_epochs", [0.0, 0.5, 1.0])
def test_no_epoch_left_to_read_means_no_writing(remaining_epochs: float) -> None:
    # Entries written in epoch e are read from epoch e+1: with <= 1 epoch left none is read.
    p = plan(2, measurements(remaining_epochs=remaining_epochs))
    assert (p.mode, p.cache_depth, p.recompute_stages) == (PlanMode.RECOMPUTE, None, (0, 2))
    assert (p.cached_fraction, p.write_epoch_extra_s) == (0.0, 0.0)
    assert p.expected_step_s == p.baseline_step_s and "epoch" in p.reason


@pytest.mark.parametrize(
    ("remaining_epochs", "mode"),
    [
        # One read epoch saves 7.96 ms/sample; 1.01 epochs -> 0.08 ms < 0.22 ms write cost.
        (1.01, PlanMode.RECOMPUTE),
        # 2 epochs: (10 + 0.22 + 2.04) / 2 = 6.1 ms vs 10 ms.
        (2.0, PlanMode.CACHE),
    ],
)
def test_write_epoch_is_amortized_over_read_epochs(remaining_epochs: float, mode: PlanMode) -> None:
    assert plan(2, measurements(remaining_epochs=remaining_epochs)).mode is mode


def test_downsampling_stage_makes_shallower_depth_the_best_cache() -> None:
    # ResNet-like: stage 0 (3 ms) ends in a downsampling stem, 200 KB; stage 1 (1 ms) widens to
    # 1.6 MB. At 200 MB/s depth 2 is fetch-bound (8 ms per entry vs 4 ms suffix); depth 1
    # arrives in 1 ms, hidden under the 1 ms recompute of stage 1 + 4 ms suffix: ~5 ms vs 8 ms.
    m = measurements(stage_forward_s_per_sample=[3 * MS, 1 * MS], entry_bytes_per_sample=[150e3, 200e3, 1.6e6],
                     suffix_step_s_per_sample=4 * MS, fetch_bytes_per_s=200e6)
    p = plan(2, m)
    assert (p.mode, p.cache_depth, p.recompute_stages, p.cached_fraction) == (PlanMode.CACHE, 1, (1, 2), 1.0)
    assert p.numbers["steady_s_per_sample"] == pytest.approx(5 * MS + 200e3 / 5e9)


def test_cpu_only_has_no_h2d_term() -> None:
    p = plan(2, measurements(h2d_bytes_per_s=None))
    assert p.numbers["transfer_s_per_sample"] == pytest.approx(200e3 / 2e9 + 1 * MS / 32)
    assert p.write_epoch_extra_s == pytest.approx(10_000 * 200e3 / 1e9)


def test_nothing_frozen_or_no_budget_recomputes() -> None:
    assert plan(0, measurements()).recompute_stages == (0, 0)
    assert plan(0, measurements()).mode is PlanMode.RECOMPUTE
    p = plan(2, measurements(budget_bytes=0.0))
    assert p.mode is PlanMode.RECOMPUTE and "budget" in p.reason


# --- plan: property ------------------------------------------------------------------

def _log(lo: int, hi: int) -> st.SearchStrategy[float]:
    """Magnitudes spread evenly over the decades 10**lo .. 10**(hi + 1)."""
    return st.builds(lambda mantissa, exp: mantissa * 10.0**exp, st.floats(1.0, 10.0), st.integers(lo, hi))


_rate = _log(3, 10)  # 1 KB/s .. 100 GB/s
_time = st.just(0.0) | _log(-7, -2)  # 0, 100 ns .. 100 ms per sample


@st.composite
def _cases(draw: st.DrawFn) -> tuple[int, Measurements, float]:
    k = draw(st.integers(1, 4))
    m = Measurements(
        stage_forward_s_per_sample=draw(st.lists(_time, min_size=k, max_size=k + 1)),
        entry_bytes_per_sample=draw(st.lists(st.just(0.0) | _log(1, 7), min_size=k + 1, max_size=k + 2)),
        fetch_bytes_per_s=draw(_rate), fetch_latency_s=draw(st.just(0.0) | _log(-6, -1)),
        write_bytes_per_s=draw(_rate), h2d_bytes_per_s=draw(st.none() | _rate),
        suffix_step_s_per_sample=draw(_time), batch_size=draw(st.integers(1, 1024)),
        num_samples=draw(st.integers(1, 10**7)), remaining_epochs=draw(st.floats(0.0, 1.0) | _log(0, 1)),
        budget_bytes=draw(st.just(0.0) | _log(3, 12) | st.just(math.inf)), decode_bytes_per_s=draw(_rate))
    return k, m, draw(st.floats(0.0, 0.5))


@settings(deadline=None)
@given(_cases())
def test_chosen_plan_never_slower_than_recompute_and_beats_a_grid(case: tuple[int, Measurements, float]) -> None:
    k, m, min_gain = case
    margin = plan(k, m, min_gain=min_gain)  # the share stops short of the balance point: a safe side
    assert margin.expected_step_s <= margin.baseline_step_s and 0.0 <= margin.cached_fraction <= 1.0
    p = plan(k, m, min_gain=min_gain, fetch_margin=0.0)  # the search itself, checked against a grid
    assert p.expected_step_s <= p.baseline_step_s
    assert 0.0 <= p.cached_fraction <= 1.0
    if p.mode is PlanMode.CACHE:
        assert p.cache_depth is not None and 1 <= p.cache_depth <= k and p.recompute_stages == (p.cache_depth, k)
        assert p.cached_fraction <= p.numbers["budget_fraction"] and p.numbers["gain"] >= min_gain
        assert m.remaining_epochs > 1
    else:
        assert p.expected_step_s == p.baseline_step_s and p.write_epoch_extra_s == 0.0
    if m.remaining_epochs <= 1:
        return
    # The endpoint-or-balance-point search must do at least as well as a brute-force grid
    # over (depth, fraction): this checks the convexity argument in the module docstring.
    pre = [sum(m.stage_forward_s_per_sample[:i]) for i in range(k + 1)]
    baseline = pre[k] + m.suffix_step_s_per_sample
    grid = []
    for j in range(1, k + 1):
        need = m.num_samples * m.entry_bytes_per_sample[j]
        c_max = 1.0 if need <= m.budget_bytes else m.budget_bytes / need
        grid += [cost_model._evaluate(j, c_max * i / 40, k, pre, m)["amortized_s_per_sample"] for i in range(1, 41)]
    tol = 1e-9 * baseline + 1e-18
    if p.mode is PlanMode.CACHE:
        assert p.expected_step_s / m.batch_size <= min(grid) + tol
    else:
        assert min(grid) >= baseline * (1 - min_gain) - tol


# --- cached_subset -------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.5, 0.9])
def test_cached_subset_hits_the_fraction(fraction: float) -> None:
    hits = sum(cached_subset(i, fraction) for i in range(100_000))
    assert abs(hits - fraction * 100_000) <= 1_000


def test_cached_subset_is_pinned_across_runs_and_processes() -> None:
    # splitmix64 reference vector (seed 0 -> first outputs) and a golden membership list:
    # both would change if the hash changed, breaking subsets already written to disk.
    assert cost_model._splitmix64(0) == 0xE220A8397B1DCDAF
    assert cost_model._splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    assert [i for i in range(32) if cached_subset(i, 0.5)] == [
        1, 4, 5, 6, 7, 11, 13, 16, 17, 18, 20, 25, 27, 28, 31]
    assert [cached_subset(i, 0.3) for i in range(1000)] == [cached_subset(i, 0.3) for i in range(1000)]


def test_cached_subset_is_nested_salted_and_total() -> None:
    ids = range(20_000)
    small, large = {i for i in ids if cached_subset(i, 0.2)}, {i for i in ids if cached_subset(i, 0.6)}
    assert small <= large
    salted = {i for i in ids if cached_subset(i, 0.2, salt=7)}
    assert abs(len(salted & small) - 0.04 * 20_000) < 400  # independent draws overlap ~ 0.2 x 0.2
    assert not any(cached_subset(i, 0.0) for i in ids) and all(cached_subset(i, 1.0) for i in ids)
    assert cached_subset(-1, 0.5) == cached_subset(2**64 - 1, 0.5)  # ids are taken mod 2**64


# --- should_replan -------------------------------------------------------------------

@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, False),
        ({"fetch_bytes_per_s": 2e9 * 0.7}, True),  # -30% > 25%
        ({"fetch_bytes_per_s": 2e9 * 1.1}, False),  # +10% is noise
        ({"fetch_latency_s": 1.25 * MS}, False),  # exactly 25% is not *more than* 25%
        ({"stage_forward_s_per_sample": [4 * MS, 6 * MS]}, True),  # one stage +50%
        ({"entry_bytes_per_sample": [150e3, 400e3, 200e3, 100e3]}, True),  # another depth appeared
        ({"h2d_bytes_per_s": None}, True),  # moved off the GPU
        ({"budget_bytes": 1e12}, True),  # unlimited -> limited
        ({"remaining_epochs": 1.0}, False),  # schedule, not a measurement
    ],
)
def test_should_replan(overrides: dict[str, object], expected: bool) -> None:
    assert should_replan(measurements(), measurements(**overrides)) is expected


def test_should_replan_threshold_is_a_parameter() -> None:
    assert should_replan(measurements(), measurements(fetch_bytes_per_s=2.2e9), drift=0.05)
    with pytest.raises(ValueError, match="drift"):
        should_replan(measurements(), measurements(), drift=math.nan)


# --- validation ----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fetch_bytes_per_s", -1.0), ("fetch_bytes_per_s", 0.0), ("fetch_bytes_per_s", math.nan),
        ("fetch_latency_s", -1e-3), ("suffix_step_s_per_sample", math.nan),
        ("stage_forward_s_per_sample", [1e-3, math.nan]), ("stage_forward_s_per_sample", "fast"),
        ("entry_bytes_per_sample", [150e3, -1.0]), ("h2d_bytes_per_s", 0.0), ("write_bytes_per_s", math.inf),
        ("decode_bytes_per_s", "5e9"), ("budget_bytes", -1.0), ("budget_bytes", math.nan),
        ("remaining_epochs", math.inf), ("remaining_epochs", -1.0),
        ("batch_size", 0), ("batch_size", 2.5), ("batch_size", True), ("num_samples", -5),
    ],
)
def test_measurements_reject_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        measurements(**{field: value})


def test_measurements_are_frozen_and_normalized() -> None:
    m = measurements()
    assert m.stage_forward_s_per_sample == (4 * MS, 4 * MS) and isinstance(m.entry_bytes_per_sample, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.batch_size = 64  # type: ignore[misc]
    with pytest.raises(TypeError):
        Measurements(1.0)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: plan(-1, measurements()), "frozen_depth"),
        (lambda: plan(True, measurements()), "frozen_depth"),  # type: ignore[arg-type]
        (lambda: plan(3, measurements()), "frozen depth 3"),
        (lambda: plan(2, measurements(entry_bytes_per_sample=[1.0, 2.0])), "entry sizes"),
        (lambda: plan(2, measurements(), min_gain=-0.1), "min_gain"),
        (lambda: cached_subset(1, 1.5), "fraction"),
        (lambda: cached_subset(1, math.nan), "fraction"),
    ],
)
def test_bad_arguments_raise(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


# --- public surface ------------------------------------------------------------------

def test_all_is_sorted_and_complete() -> None:
    assert cost_model.__all__ == sorted(cost_model.__all__)
    public = {n for n, v in vars(cost_model).items()
              if not n.startswith("_") and getattr(v, "__module__", None) == cost_model.__name__}
    assert set(cost_model.__all__) == public


def test_module_imports_without_torch() -> None:
    path = Path(cost_model.__file__)
    code = (f"import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('cm', {str(path)!r})\n"
            f"sys.modules['cm'] = module = importlib.util.module_from_spec(spec)\n"
            f"spec.loader.exec_module(module)\n"
            f"assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n")
    assert importlib.util.find_spec("actcache_client.cost_model") is not None
    subprocess.run([sys.executable, "-c", code], check=True)


def test_entries_already_written_are_read_even_in_the_last_epoch():
    # 1 epoch remains: nothing new is written, but a filled cache at depth 2 still pays.
    m = Measurements(
        stage_forward_s_per_sample=[1e-3, 1e-3], entry_bytes_per_sample=[0.0, 32e3, 32e3],
        fetch_bytes_per_s=1e9, fetch_latency_s=1e-3, write_bytes_per_s=5e8, h2d_bytes_per_s=None,
        suffix_step_s_per_sample=1e-3, batch_size=16, num_samples=1000, remaining_epochs=1.0,
        budget_bytes=math.inf, decode_bytes_per_s=2e9,
    )
    assert plan(2, m).mode is PlanMode.RECOMPUTE
    filled = plan(2, dataclasses.replace(m, written_fraction=[0.0, 0.0, 1.0]))
    assert filled.mode is PlanMode.CACHE and filled.cache_depth == 2 and filled.write_epoch_extra_s == 0.0
    half = plan(2, dataclasses.replace(m, written_fraction=[0.0, 0.0, 0.5]))
    assert half.mode is PlanMode.CACHE and half.cached_fraction == 0.5


def test_a_nearly_filled_cache_is_completed_not_left_at_its_fill():
    # 99% of the samples are stored at depth 2; writing the last 1% costs only their put, so the
    # plan caches them all (a model charging a whole recompute epoch for that would stop at 99%).
    m = Measurements(
        stage_forward_s_per_sample=[1e-3, 1e-3], entry_bytes_per_sample=[0.0, 32e3, 32e3],
        fetch_bytes_per_s=1e9, fetch_latency_s=1e-4, write_bytes_per_s=5e8, h2d_bytes_per_s=None,
        suffix_step_s_per_sample=1e-3, batch_size=16, num_samples=1000, remaining_epochs=2.0,
        budget_bytes=math.inf, decode_bytes_per_s=2e9, written_fraction=[0.0, 0.0, 0.99],
    )
    p = plan(2, m)
    assert p.mode is PlanMode.CACHE and p.cached_fraction == 1.0
    assert p.write_epoch_extra_s == pytest.approx(0.01 * 1000 * 32e3 / 5e8)  # only the missing 1% is written
    last = plan(2, dataclasses.replace(m, remaining_epochs=1.0))
    assert last.mode is PlanMode.CACHE and last.cached_fraction == 0.99  # nothing new in the last epoch
