"""The reference process: messages and main loop (runs in a spawned CPU process).

Inbox, in order: ``Snapshot`` (the frontmost stage at one evaluation: the
first of a generation carries the pickled module, later ones its state_dict in
shared memory), ``Probe`` (that stage's input for one batch), ``Stop``.
Outbox: exactly one ``Reading`` or ``Dropped`` per probe, ``Built`` when a
stage's first reference is built (and timed), ``Failed`` on any error.
A snapshot is loaded lazily and kept until no later probe can need it.
"""

from __future__ import annotations

import copy
import os
import pickle
import queue
import timeit
import traceback
from dataclasses import dataclass
from typing import cast

import torch

from actcache_client.freeze.plasticity import sp_loss
from actcache_client.transport._state import State

#: How often a waiting reference process checks that its parent is still alive.
PARENT_CHECK_S = 5.0
#: Runs of a generation's first reference on its first probe; the fastest is reported.
TIMING_RUNS = 5


@dataclass(frozen=True)
class Snapshot:
    generation: int
    index: int  # evaluations since the generation started
    stage: int
    age: int  # evaluations between the two references of a reading
    payload: bytes | None = None  # pickle.dumps of the stage module on the CPU (index 0 of a generation)
    state: dict[str, State] | None = None  # its state_dict in shared memory (later indices)


@dataclass(frozen=True)
class Probe:
    generation: int
    index: int  # the snapshot taken at the evaluation just before the probed step
    step: int
    inputs: State


@dataclass(frozen=True)
class Stop:
    """Tells the reference process to end."""


@dataclass(frozen=True)
class Reading:
    generation: int
    stage: int
    step: int
    index: int
    plasticity: float  # SP loss between the references ``age`` evaluations apart
    age: int


@dataclass(frozen=True)
class Dropped:
    reason: str  # why the probe got no reading (for debugging: the worker only counts it)


@dataclass(frozen=True)
class Built:
    generation: int
    index: int
    stage: int
    ms_per_batch: float  # the fastest of TIMING_RUNS runs on the first probe's input


@dataclass(frozen=True)
class Failed:
    traceback: str


def main(inbox, outbox, threads: int, parent_pid: int) -> None:
    """Serve probes until Stop, or until the parent process is gone; an error goes to the parent as Failed."""
    try:
        torch.set_num_threads(threads)
        _serve(inbox, outbox, parent_pid)
    except BaseException:
        outbox.put(Failed(traceback.format_exc()))


class _Generation:
    """The snapshots of one frontmost stage, by evaluation index, and their loaded references."""

    def __init__(self, first: Snapshot) -> None:
        self.first = first
        self.module: torch.nn.Module = pickle.loads(cast(bytes, first.payload))
        self.states: dict[int, dict[str, State] | None] = {first.index: None}  # None: the module as sent
        self.runs: dict[int, torch.nn.Module] = {}

    def reference(self, index: int, example: State, timed: set[int], outbox) -> torch.nn.Module:
        """Snapshot ``index`` as a reference; the stage's first one (not in ``timed``) is timed on ``example``."""
        if index in self.runs:
            return self.runs[index]
        module = self.module  # sent in eval mode
        state = self.states[index]
        if state is not None:
            module = copy.deepcopy(self.module)
            module.load_state_dict(state)
        if self.first.stage not in timed:
            timed.add(self.first.stage)
            outbox.put(Built(self.first.generation, index, self.first.stage, _ms_per_batch(module, example)))
        self.runs[index] = module
        return module

    def prune(self, below: int) -> None:
        """Forget snapshots no later probe can use (every later probe has a larger index)."""
        for index in [i for i in self.states if i < below]:
            del self.states[index]
            self.runs.pop(index, None)


def _ms_per_batch(module: torch.nn.Module, example: State) -> float:
    with torch.no_grad():
        module(example)  # raises here, before any timing, if the stage cannot run
        return 1e3 * min(timeit.repeat(lambda: module(example), number=1, repeat=TIMING_RUNS))


def _serve(inbox, outbox, parent_pid: int) -> None:
    current: _Generation | None = None
    timed: set[int] = set()  # stages whose reference was timed
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
            if message.payload is not None:
                current = _Generation(message)
            elif current is not None and current.first.generation == message.generation:
                current.states[message.index] = message.state
                # every probe of an earlier index is in already: none needs a snapshot below index - age
                current.prune(message.index - current.first.age)
            continue
        probe: Probe = message
        if current is None or probe.generation != current.first.generation:
            outbox.put(Dropped(f"step {probe.step}: no reference snapshot of generation {probe.generation} yet"))
            continue
        age = current.first.age
        missing = [i for i in (probe.index - age, probe.index) if i not in current.states]
        if missing:
            outbox.put(Dropped(f"step {probe.step}: snapshot(s) {missing} of generation {probe.generation} "
                               "never arrived"))
            continue
        old = current.reference(probe.index - age, probe.inputs, timed, outbox)
        new = current.reference(probe.index, probe.inputs, timed, outbox)
        with torch.no_grad():
            plasticity = sp_loss(new(probe.inputs), old(probe.inputs))
        outbox.put(Reading(probe.generation, current.first.stage, probe.step, probe.index, plasticity, age))
        current.prune(probe.index - age)
