"""The reference process: readings, skips instead of waits, failures delivered to the training side."""

from __future__ import annotations

import copy
import queue
import threading
import time

import pytest
import torch
from torch import nn

from actcache.errors import ReferenceModelFailed
from actcache_client.freeze import ReferenceConfig, ReferenceState, ReferenceWorker, sp_loss
from actcache_client.freeze._refproc import Built, Reading
from actcache_client.freeze.reference import MAX_PENDING_SNAPSHOTS, _CpuLoad, to_shared

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

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
    return stage, x


def test_a_reading_compares_snapshots_age_apart_on_the_same_batch_and_is_zero_for_identical_weights():
    stage, x = stage_and_probe()
    frozen_copies = []
    worker = ReferenceWorker(ReferenceConfig(queue_size=4))
    assert worker.config.max_cpu_percent is None  # "auto" with training on the CPU
    worker.start()
    try:
        assert worker.submit(0, 0, 1, to_shared(x))  # before any snapshot: answered, dropped
        for index in range(3):  # evaluations 0..2: the stage moves on after the first snapshot only
            worker.snapshot(stage, stage=0, generation=0, index=index, age=2)
            frozen_copies.append(copy.deepcopy(stage).eval())
            if index == 0:
                with torch.no_grad():
                    stage[0].weight.mul_(0.7).add_(0.1)
        assert worker.submit(0, 1, 5, to_shared(x))  # index 1 - age 2: no such snapshot
        assert worker.submit(0, 2, 6, to_shared(x))
        worker.snapshot(stage, stage=0, generation=0, index=3, age=2)
        assert worker.submit(0, 3, 7, to_shared(x))  # snapshots 1 and 3 hold the same weights
        messages = wait_for(worker, Reading, 2)  # answered in order: the two drops came before them
    finally:
        worker.close()
    moved, still = [m for m in messages if isinstance(m, Reading)]
    with torch.no_grad():
        expected = sp_loss(frozen_copies[2](x), frozen_copies[0](x))
    assert (moved.step, moved.index, moved.age, moved.stage) == (6, 2, 2, 0)
    assert moved.plasticity == pytest.approx(expected, rel=1e-6) and moved.plasticity > 0
    # Both sides of a reading are eval-mode references, so identical weights read exactly 0 (no train-mode floor).
    assert (still.step, still.index) == (7, 3) and still.plasticity == 0.0
    built = next(m for m in messages if isinstance(m, Built))
    assert built.stage == 0 and built.ms_per_batch > 0
    assert worker.stats.dropped == 2 and worker.stats.readings == 2 and worker.stats.in_flight == 0
    assert worker.stats.snapshots == 4 and worker.state is ReferenceState.CLOSED


def test_snapshots_wait_in_order_while_the_inbox_is_full_and_the_oldest_are_dropped():
    class Full:
        def put_nowait(self, message):
            raise queue.Full

    stage, _ = stage_and_probe()
    worker = ReferenceWorker(ReferenceConfig())
    worker.state, worker._inbox = ReferenceState.RUNNING, Full()  # no process: the inbox never takes anything
    for index in range(MAX_PENDING_SNAPSHOTS + 5):
        worker.snapshot(stage, stage=0, generation=3, index=index, age=2)
    pending = list(worker._pending)
    assert len(pending) == MAX_PENDING_SNAPSHOTS and worker.stats.snapshots_dropped == 5
    assert pending[0].index == 0 and pending[0].payload is not None  # the one that opens the generation stays
    assert [m.index for m in pending[1:]] == list(range(6, MAX_PENDING_SNAPSHOTS + 5))
    assert all(m.state is not None and m.payload is None for m in pending[1:])
    worker.snapshot(stage, stage=1, generation=4, index=0, age=2)  # a new generation: the old one is of no use
    assert [(m.generation, m.index) for m in worker._pending] == [(4, 0)]


def test_max_cpu_percent_auto_follows_where_training_runs():
    assert ReferenceConfig().max_cpu_percent == "auto"
    assert ReferenceConfig().for_device("cpu").max_cpu_percent is None
    assert ReferenceConfig().for_device("cuda:0").max_cpu_percent == 50.0
    assert ReferenceConfig(max_cpu_percent=30).for_device("cpu").max_cpu_percent == 30
    assert ReferenceWorker(training_device="cuda").config.max_cpu_percent == 50.0
    assert ReferenceConfig().age_for(10) == 5 and ReferenceConfig().age_for(2) == 1
    assert ReferenceConfig(reference_age=3).age_for(10) == 3


def test_a_busy_reference_process_turns_probes_into_skips_not_waits():
    _, x = stage_and_probe()
    worker = ReferenceWorker(ReferenceConfig(max_cpu_percent=None, queue_size=1))
    worker.start()
    try:
        worker.snapshot(Stall(), stage=0, generation=0)
        results = [worker.submit(0, 0, step, to_shared(x)) for step in range(1, 21)]
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
    _, x = stage_and_probe()
    worker = ReferenceWorker(ReferenceConfig(max_cpu_percent=None))
    worker.start()
    try:
        worker.snapshot(Broken(), stage=0, generation=0, index=0, age=1)
        worker.snapshot(Broken(), stage=0, generation=0, index=1, age=1)
        worker.submit(0, 1, 1, to_shared(x))
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
