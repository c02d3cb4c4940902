"""The reference process: messages and main loop (runs in a spawned CPU process).

Inbox, in order: ``Snapshot`` (a pickled CPU copy of the frontmost active
stage), ``Probe`` (that stage's input and the training model's output for one
batch), ``Stop``. Outbox: ``Loaded`` for every snapshot, exactly one
``Reading`` or ``Dropped`` for every probe, ``Built`` when a snapshot's
reference is first built, ``Failed`` (then the process exits) on any error.

The reference of a snapshot is built lazily on its first probe, which also
calibrates static int8. Under ``precision="auto"`` the choice made for a
stage is kept for its later snapshots, so candidates are timed once per stage.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass, field

import torch

from actcache_client.freeze.plasticity import sp_loss
from actcache_client.freeze.quantize import BuiltReference, build_reference
from actcache_client.stages import State

#: How often a waiting reference process checks that its parent is still alive.
PARENT_CHECK_S = 5.0


@dataclass(frozen=True)
class Snapshot:
    generation: int
    snapshot_id: int
    stage: int
    payload: bytes  # pickle.dumps of the stage module on the CPU
    precision: str


@dataclass(frozen=True)
class Probe:
    generation: int
    step: int
    inputs: State
    output: State


@dataclass(frozen=True)
class Stop:
    """Tells the reference process to end."""


@dataclass(frozen=True)
class Loaded:
    snapshot_id: int


@dataclass(frozen=True)
class Reading:
    generation: int
    snapshot_id: int
    stage: int
    step: int
    plasticity: float
    seconds: float


@dataclass(frozen=True)
class Dropped:
    generation: int
    step: int
    reason: str


@dataclass(frozen=True)
class Built:
    generation: int
    snapshot_id: int
    stage: int
    precision: str
    ms_per_batch: dict[str, float]
    error_vs_fp32: dict[str, float]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Failed:
    traceback: str


def main(inbox, outbox, threads: int, parent_pid: int) -> None:
    """Serve probes until Stop, or until the parent process is gone."""
    try:
        torch.set_num_threads(threads)
        _serve(inbox, outbox, parent_pid)
    except BaseException:  # delivered to the training process, which raises it
        outbox.put(Failed(traceback.format_exc()))


def _serve(inbox, outbox, parent_pid: int) -> None:
    snapshot: Snapshot | None = None
    module: torch.nn.Module | None = None
    built: BuiltReference | None = None
    chosen: dict[int, str] = {}  # stage -> precision picked by "auto"
    while True:
        try:
            message = inbox.get(timeout=PARENT_CHECK_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return
            continue
        if isinstance(message, Stop):
            return
        if isinstance(message, Snapshot):
            snapshot, built = message, None
            module = pickle.loads(message.payload)
            outbox.put(Loaded(message.snapshot_id))
            continue
        probe: Probe = message
        if snapshot is None or module is None or probe.generation != snapshot.generation:
            outbox.put(Dropped(probe.generation, probe.step, "no reference snapshot of this stage yet"))
            continue
        if built is None:
            built = build_reference(module, chosen.get(snapshot.stage, snapshot.precision), probe.inputs)
            chosen.setdefault(snapshot.stage, built.precision)
            outbox.put(Built(snapshot.generation, snapshot.snapshot_id, snapshot.stage, built.precision,
                             built.ms_per_batch, built.error_vs_fp32, built.notes))
        start = time.perf_counter()
        with torch.no_grad():
            plasticity = sp_loss(probe.output, built.run(probe.inputs))
        outbox.put(Reading(snapshot.generation, snapshot.snapshot_id, snapshot.stage, probe.step, plasticity,
                           time.perf_counter() - start))
