"""Rank 0's side of Egeria's plasticity: a snapshot per evaluation, one probe per interval, the latest reading.

One evaluation interval (n = eval_every steps)::

    evaluation k   -> interval_done(): start the reference process once the policy has left
                      bootstrapping (snapshot 0), else send snapshot k of the frontmost stage
    step k*n + 1   -> the training forward's input to the frontmost stage is copied by a tap
                      (armed by arm() once snapshot k - age exists, if the queue has room and
                      the CPU is not busy; else the interval's probe is skipped, counted);
                      step() sends it to the reference process, tagged k
    evaluation k+1 -> reading(): the latest plasticity reading of the current stage, if one arrived

A depth change starts a new generation: readings of the old stage are
ignored, the new frontmost stage gets snapshot 0. Nothing here waits.
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
        self._capture_index: int | None = None  # the snapshot before the forward being captured
        self._inputs: Any = None

    @property
    def stats(self) -> ReferenceStats:
        return self.worker.stats

    @property
    def running(self) -> bool:
        return self.worker.state is ReferenceState.RUNNING

    def _head_only(self) -> bool:
        return self.cached.frozen >= self.cached.model.num_stages - 1  # nothing left to judge

    def step(self, step: int) -> None:
        """Send the probe captured in this step's forward, if any."""
        if self._capture_index is not None and self._inputs is not None:
            self.worker.submit(self._generation, self._capture_index, step, self._inputs)
            self._capture_index, self._inputs = None, None

    def arm(self) -> None:
        """Capture the next training forward, once per interval, if a reading can come of it."""
        if (not self.running or self._probed or self._capture_index is not None or self._head_only()
                or self._index < self._age):
            return
        self._probed = True
        if self.worker.ready_for_probe():
            self._capture_index = self._index
            self.cached.tap_training_input(self._take)

    def _take(self, state: Any) -> None:
        self._inputs = to_shared(state, self.worker.config.max_samples)

    def reading(self, step: int) -> _refproc.Reading | None:
        """The latest reading of the current frontmost stage that arrived since the last call."""
        latest = None
        for message in self.worker.poll():
            if isinstance(message, _refproc.Built):  # a stage's first reference, and its speed
                log.info("actcache: reference of stage %d (%s): %.2f ms per batch", message.stage,
                         self.cached.model.stage_names[message.stage], message.ms_per_batch)
                self.timeline.write({"event": "reference", "step": step, "stage": message.stage,
                                     "ms_per_batch": message.ms_per_batch})
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
        if self._capture_index is not None:
            self.cached.tap_training_input(None)
            self._capture_index, self._inputs = None, None

    def close(self) -> None:
        self._drop_capture()
        self.worker.close()
