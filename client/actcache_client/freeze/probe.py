"""Rank 0's side of Egeria's plasticity: a snapshot per evaluation, one probe per interval, the latest reading.

Timeline of one evaluation interval (n = eval_every steps)::

    evaluation k  ->  interval_done(): start the reference process once the policy has left
                      bootstrapping (snapshot 0 of the frontmost stage), else send snapshot k
                      of the frontmost stage (its weights now, after step k*n)
    step k*n + 1  ->  the training forward gives the frontmost active stage's input to a tap, which copies it
                      (armed by arm() at the end of the previous step, once snapshot k - age
                      exists, if the queue has room and the CPU is not busy: otherwise the
                      interval's probe is skipped, counted)
                  ->  step(): the copies go to the reference process (put_nowait), tagged k
    evaluation k+1 -> reading(): the latest plasticity reading of the current stage, if one arrived

The reading compares the probe with snapshots k - age and k (reference.py).
A depth change bumps the generation: readings of the old stage are ignored,
the new frontmost stage gets snapshot 0 (and its first reading ``age``
evaluations later). Nothing here waits.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from actcache_client._cached_forward import CachedForward
from actcache_client.freeze import _refproc
from actcache_client.freeze.policy import FreezePolicy
from actcache_client.freeze.reference import ReferenceConfig, ReferenceState, ReferenceStats, ReferenceWorker, to_shared
from actcache_client.freeze.timeline import Timeline

__all__ = ["PlasticityProbe"]

log = logging.getLogger("actcache_client.freeze")


class _Capture:
    """One training forward's input to the frontmost active stage, copied to shared memory."""

    def __init__(self, cached: CachedForward, rows: int | None, index: int) -> None:
        self.cached = cached
        self.rows = rows
        self.index = index  # the snapshot taken just before this forward
        self.inputs: Any = None
        cached.tap_training_input(self._take)

    def _take(self, state: Any) -> None:
        self.inputs = to_shared(state, self.rows)

    @property
    def done(self) -> bool:
        return self.inputs is not None

    def remove(self) -> None:
        if not self.done:
            self.cached.tap_training_input(None)


class PlasticityProbe:
    """Feeds the reference process from the training forward; at most one probe per interval."""

    def __init__(self, cached: CachedForward, policy: FreezePolicy, config: ReferenceConfig | None,
                 timeline: Timeline) -> None:
        self.cached = cached
        self.policy = policy
        self.timeline = timeline
        device = next((p.device for p in cached.model.parameters()), torch.device("cpu"))
        self.worker = ReferenceWorker(config, training_device=device)
        self._generation = 0
        self._index = -1  # snapshots sent in this generation, minus one
        self._age = 1
        self._snapped = False  # a snapshot was sent during the current evaluation
        self._probed = False
        self._capture: _Capture | None = None

    @property
    def stats(self) -> ReferenceStats:
        return self.worker.stats

    @property
    def running(self) -> bool:
        return self.worker.state is ReferenceState.RUNNING

    def _head_only(self) -> bool:
        return self.cached.frozen >= self.cached.model.num_stages - 1  # nothing left to judge

    # ---- per step -------------------------------------------------------

    def step(self, step: int) -> None:
        """Send the probe captured in this step's forward, if any."""
        capture = self._capture
        if capture is not None and capture.done:
            self._capture = None
            self.worker.submit(self._generation, capture.index, step, capture.inputs)

    def arm(self) -> None:
        """Capture the next training forward, once per interval, if a reading can come of it."""
        if (not self.running or self._probed or self._capture is not None or self._head_only()
                or self._index < self._age):
            return
        self._probed = True
        if self.worker.ready_for_probe():
            self._capture = _Capture(self.cached, self.worker.config.max_samples, self._index)

    # ---- per evaluation ---------------------------------------------------

    def reading(self, step: int) -> _refproc.Reading | None:
        """The latest reading of the current frontmost stage that arrived since the last call."""
        latest = None
        for message in self.worker.poll():
            if isinstance(message, _refproc.Built):
                self._report_build(message, step)
            elif message.generation == self._generation and (latest is None or message.step >= latest.step):
                latest = message
        return latest

    def interval_done(self) -> None:
        """After an evaluation: a new interval (one probe); start the reference or send this evaluation's snapshot."""
        self._probed = False
        snapped, self._snapped = self._snapped, False
        if getattr(self.policy, "bootstrapping", False) or self._head_only() or snapped:
            return
        if self.worker.state is ReferenceState.NEW:
            self.worker.start()
        if self.running:
            self._snapshot()

    def depth_changed(self) -> None:
        """The frontmost stage changed: old readings are void, the new stage starts a generation."""
        self._generation += 1
        self._index = -1
        self._drop_capture()
        if self.running and not self._head_only():
            self._snapshot()
            self._snapped = True

    def _snapshot(self) -> None:
        self._drop_capture()
        if self._index < 0:  # a new generation: the policy's W may have changed (unfreezing halves it)
            self._age = self.worker.config.age_for(int(getattr(self.policy, "window", 10)))
        self._index += 1
        frozen = self.cached.frozen
        self.worker.snapshot(self.cached.model.stages[frozen], stage=frozen, generation=self._generation,
                             index=self._index, age=self._age)

    def _drop_capture(self) -> None:
        if self._capture is not None:
            self._capture.remove()
            self._capture = None

    def _report_build(self, built: _refproc.Built, step: int) -> None:
        """Log and record a stage's first reference and its speed."""
        log.info("actcache: reference of stage %d (%s): %.2f ms per batch", built.stage,
                 self.cached.model.stage_names[built.stage], built.ms_per_batch)
        self.timeline.write({"event": "reference", "step": step, "stage": built.stage,
                             "ms_per_batch": built.ms_per_batch})

    def close(self) -> None:
        self._drop_capture()
        self.worker.close()
