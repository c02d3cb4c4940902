"""The reference process: readings, skips instead of waits, failures delivered to the training side."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from actcache.errors import ReferenceModelFailed
from actcache_client.freeze import ReferenceConfig, ReferenceState, ReferenceWorker, sp_loss
from actcache_client.freeze._refproc import Built, Reading
from actcache_client.freeze.reference import _CpuLoad, to_shared

WAIT_S = 120.0  # an upper bound for a loaded machine, never a timing assertion


class Stall(nn.Module):
    """A stage whose forward blocks until its process is terminated: the reference falls behind."""

    def forward(self, x):
        threading.Event().wait()
        return x


class Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("this stage cannot run")


def wait_for(worker: ReferenceWorker, kind: type, count: int = 1) -> list:
    """Messages until ``count`` of ``kind`` arrived (blocking on the worker's queue, bounded by WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    seen: list = []
    while sum(isinstance(m, kind) for m in seen) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {kind.__name__} within {WAIT_S} s; got {seen}"
        seen += worker.poll(wait_s=remaining)
    return seen


def stage_and_probe(seed: int = 0):
    torch.manual_seed(seed)
    stage = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval()
    x = torch.randn(6, 3, 8, 8)
    with torch.no_grad():
        return stage, x, stage(x)


def test_plasticity_is_the_sp_loss_of_the_same_input_through_the_snapshot():
    stage, x, out = stage_and_probe()
    worker = ReferenceWorker(ReferenceConfig(precision="fp32", max_cpu_percent=None, queue_size=3))
    worker.start()
    try:
        assert worker.submit(0, 1, to_shared(x), to_shared(out))  # before any snapshot: answered, dropped
        worker.snapshot(stage, stage=0, generation=0)
        with torch.no_grad():
            stage[0].weight.mul_(-1)  # the training stage moves on; the snapshot keeps the old weights
            moved = stage(x)
        assert worker.submit(0, 2, to_shared(x), to_shared(out))
        assert worker.submit(0, 3, to_shared(x), to_shared(moved))
        messages = wait_for(worker, Reading, 2)
    finally:
        worker.close()
    readings = [m for m in messages if isinstance(m, Reading)]
    assert [r.step for r in readings] == [2, 3] and all(r.stage == 0 and r.generation == 0 for r in readings)
    assert readings[0].plasticity == pytest.approx(0.0, abs=1e-12)
    assert readings[1].plasticity == pytest.approx(sp_loss(moved, out), rel=1e-6) and readings[1].plasticity > 0
    built = next(m for m in messages if isinstance(m, Built))
    assert built.precision == "fp32" and built.ms_per_batch["fp32"] > 0
    assert worker.stats.dropped == 1 and worker.stats.readings == 2 and worker.stats.in_flight == 0
    assert worker.state is ReferenceState.CLOSED


def test_a_busy_reference_process_turns_probes_into_skips_not_waits():
    _, x, out = stage_and_probe()
    worker = ReferenceWorker(ReferenceConfig(precision="fp32", max_cpu_percent=None, queue_size=1))
    worker.start()
    try:
        worker.snapshot(Stall(), stage=0, generation=0)
        results = [worker.submit(0, step, to_shared(x), to_shared(out)) for step in range(1, 21)]
        assert results[0] and not any(results[1:])
        assert worker.stats.submitted == 1 and worker.stats.skipped_full == 19 and worker.stats.in_flight == 1
        assert not worker.ready_for_probe() and worker.stats.skipped_full == 20
        assert not any(isinstance(m, Reading) for m in worker.poll())
    finally:
        worker.close(timeout_s=1.0)  # the stalled process is terminated
    assert worker.state is ReferenceState.CLOSED


def test_cpu_back_off_counts_skips():
    loads = iter([80.0, 20.0])
    worker = ReferenceWorker(ReferenceConfig(max_cpu_percent=50), cpu_percent=lambda: next(loads))
    worker.state = ReferenceState.RUNNING  # no process needed: the check happens before a probe is taken
    assert not worker.ready_for_probe() and worker.stats.skipped_busy == 1 and worker.last_cpu_percent == 80.0
    assert worker.ready_for_probe() and worker.stats.skipped_busy == 1
    load = _CpuLoad()
    assert 0.0 <= load.percent() <= 100.0  # the default reader, from psutil.cpu_times deltas


def test_a_failing_reference_raises_in_the_training_process():
    _, x, out = stage_and_probe()
    worker = ReferenceWorker(ReferenceConfig(precision="fp32", max_cpu_percent=None))
    worker.start()
    try:
        worker.snapshot(Broken(), stage=0, generation=0)
        worker.submit(0, 1, to_shared(x), to_shared(out))
        with pytest.raises(ReferenceModelFailed, match="this stage cannot run"):
            wait_for(worker, Reading)
        assert worker.state is ReferenceState.FAILED and worker.poll() == []
    finally:
        worker.close()
    with pytest.raises(Exception, match="cannot be pickled"):
        ReferenceWorker().snapshot(nn.Sequential(Lambda()), stage=0, generation=0)


class Lambda(nn.Module):
    def __init__(self):
        super().__init__()
        self.fn = lambda x: x

    def forward(self, x):
        return self.fn(x)
