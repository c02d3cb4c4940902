"""Egeria's reference model, run in a separate CPU process that training never waits for, and what feeds it.

A probe sends x, the input of the frontmost active stage s in one training
forward; the process answers ``sp_loss(ref_s[now](x), ref_s[now - age](x))``
from two eval-mode snapshots of s ``reference_age`` evaluations apart
(docs/design/egeria.md says why).

Lifecycle (``state``)::

    NEW --start()--> RUNNING --close()--> CLOSED
                        '--child error or exit--> FAILED (poll raises ReferenceModelFailed once)

Never blocking: ``submit`` and ``snapshot`` only ``put_nowait``; ``poll`` only
``get_nowait``. Invariants: answered <= submitted and submitted - answered <=
queue_size (a probe past that is skipped and counted, as is one offered while
the CPU is busier than ``max_cpu_percent``); snapshots the inbox cannot take
wait in order, at most ``MAX_PENDING_SNAPSHOTS``, the oldest dropped and counted.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import logging
import os
import pickle
import queue
from typing import Any, Callable

import psutil
import torch
import torch.multiprocessing as mp
from torch import nn

from actcache.errors import ConfigError, LifecycleError, ReferenceModelFailed
from actcache_client.engine._cached_forward import CachedForward
from actcache_client.freeze import _refproc
from actcache_client.freeze.policy import FreezePolicy
from actcache_client.freeze.timeline import Timeline
from actcache_client.transport._state import State, map_state

__all__ = ["PlasticityProbe", "ReferenceConfig", "ReferenceState", "ReferenceStats", "ReferenceWorker", "to_shared"]

log = logging.getLogger("actcache_client.freeze")

#: Snapshots kept on the training side while the inbox is full; older ones are dropped.
MAX_PENDING_SNAPSHOTS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    """How the reference model is built and run.

    Attributes:
        reference_age: Evaluations between the two snapshots a reading compares; None: max(1, W // 2)
            (Egeria §4.1.3).
        queue_size: Probes waiting for or in the reference process; more are skipped (Egeria §4.1.2:
            non-blocking).
        max_cpu_percent: Skip probes while system CPU use over the last interval is above this percentage;
            None never skips. "auto": None when training on the CPU (it keeps the CPU busy), else 50
            (Egeria §4.1.2).
        threads: torch threads of the reference process.
        max_samples: Compare only the first this many samples of a batch (None: the whole batch, as Egeria).

    Raises:
        ConfigError: A field is out of range.
    """

    #: Evaluations between the two snapshots a reading compares; None: max(1, W // 2) (Egeria §4.1.3).
    reference_age: int | None = None
    #: Probes waiting for or in the reference process; more are skipped (Egeria §4.1.2: non-blocking).
    queue_size: int = 1
    #: Skip probes while system CPU use over the last interval is above this percentage; None never
    #: skips. "auto": None when training on the CPU (it keeps the CPU busy), else 50 (Egeria §4.1.2).
    max_cpu_percent: float | str | None = "auto"
    #: torch threads of the reference process.
    threads: int = 1
    #: Compare only the first this many samples of a batch (None: the whole batch, as Egeria).
    max_samples: int | None = None

    def __post_init__(self) -> None:
        if self.reference_age is not None and self.reference_age < 1:
            raise ConfigError(f"reference_age={self.reference_age} must be >= 1 evaluation (or None for W / 2)")
        if self.queue_size < 1:
            raise ConfigError(f"queue_size={self.queue_size} must be >= 1 probe")
        limit = self.max_cpu_percent
        if limit != "auto" and limit is not None and (isinstance(limit, str) or not 0 < limit <= 100):
            raise ConfigError(f"max_cpu_percent={limit!r} must be in (0, 100], None to never back off, or "
                              "'auto' (None when training on the CPU, else 50 as Egeria)")
        if self.threads < 1:
            raise ConfigError(f"threads={self.threads} must be >= 1")
        if self.max_samples is not None and self.max_samples < 2:
            raise ConfigError(f"max_samples={self.max_samples}: the SP loss compares samples; use >= 2 or None")

    def for_device(self, device: torch.device | str) -> ReferenceConfig:
        """This configuration with ``max_cpu_percent="auto"`` resolved for a trainer on ``device``.

        Args:
            device: The training device.
        """
        if self.max_cpu_percent != "auto":
            return self
        return dataclasses.replace(self, max_cpu_percent=None if torch.device(device).type == "cpu" else 50.0)

    def age_for(self, window: int) -> int:
        """The reference age: ``reference_age``, else max(1, W // 2).

        Args:
            window: The policy's window W.
        """
        return self.reference_age or max(1, window // 2)


@dataclasses.dataclass
class ReferenceStats:
    """What the reference process did; the controller copies these into the timeline.

    Attributes:
        submitted: Probes queued.
        answered: Probes answered (a reading or a drop).
        readings: Probes answered with a reading.
        dropped: Probes answered without a reading.
        skipped_full: Probes skipped because the queue was full.
        skipped_busy: Probes skipped because the system CPU was busy.
        snapshots: Snapshots sent.
        snapshots_dropped: Snapshots dropped because the inbox stayed full (their readings are dropped in turn).
        builds: The first build of each stage's reference: its speed (``_refproc.Built`` as a dict).
    """

    submitted: int = 0
    answered: int = 0
    readings: int = 0
    dropped: int = 0
    skipped_full: int = 0
    skipped_busy: int = 0
    snapshots: int = 0
    #: Snapshots dropped because the inbox stayed full (their readings are dropped in turn).
    snapshots_dropped: int = 0
    #: The first build of each stage's reference: its speed (``_refproc.Built`` as a dict).
    builds: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def in_flight(self) -> int:
        return self.submitted - self.answered


class ReferenceState(enum.Enum):
    """Lifecycle of a ReferenceWorker (transitions in the module docstring)."""

    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"
    FAILED = "failed"


class _CpuLoad:
    """System CPU use since the previous call, from psutil.cpu_times deltas (no shared psutil state)."""

    def __init__(self) -> None:
        self._last = psutil.cpu_times()

    def percent(self) -> float:
        now = psutil.cpu_times()
        total = sum(now) - sum(self._last)
        idle = (now.idle + getattr(now, "iowait", 0.0)) - (self._last.idle + getattr(self._last, "iowait", 0.0))
        self._last = now
        return 0.0 if total <= 0 else 100.0 * (1.0 - idle / total)


def to_shared(state: State, rows: int | None = None) -> State:
    """A copy of ``state`` in shared memory, detached, on the CPU.

    Args:
        state: The tensors to copy.
        rows: Copy only the first this many samples (None: all).
    """

    def shared(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()[:rows] if rows is not None else t.detach()
        return torch.empty(t.shape, dtype=t.dtype).share_memory_().copy_(t)

    return map_state(state, shared)


class ReferenceWorker:
    """The training side of the reference process (one per training job, on rank 0).

    Args:
        config: How the reference model is built and run; default: ``ReferenceConfig()``.
        training_device: Resolves ``max_cpu_percent="auto"``.
        cpu_percent: ``cpu_percent()`` gives the system CPU use since its last call (default: from psutil).
    """

    def __init__(self, config: ReferenceConfig | None = None, *, training_device: torch.device | str = "cpu",
                 cpu_percent: Callable[[], float] | None = None) -> None:
        self.config = (config or ReferenceConfig()).for_device(training_device)
        self.stats = ReferenceStats()
        self.state = ReferenceState.NEW
        self.last_cpu_percent: float | None = None
        self._ctx = mp.get_context("spawn")
        self._inbox: Any = None
        self._outbox: Any = None
        self._process: Any = None
        self._cpu_percent = cpu_percent or _CpuLoad().percent
        self._pending: collections.deque[_refproc.Snapshot] = collections.deque()
        self._warned_busy = False

    def start(self) -> None:
        """Spawn the process (returns once it is launched, not once it has imported torch)."""
        if self.state is not ReferenceState.NEW:
            raise LifecycleError(f"ReferenceWorker.start() in state {self.state.value}; a worker starts once")
        self._inbox = self._ctx.Queue(maxsize=self.config.queue_size + MAX_PENDING_SNAPSHOTS + 1)
        self._outbox = self._ctx.Queue()
        self._process = self._ctx.Process(target=_refproc.main, name="actcache-reference", daemon=True,
                                          args=(self._inbox, self._outbox, self.config.threads, os.getpid()))
        self._process.start()
        self.state = ReferenceState.RUNNING

    def snapshot(self, module: nn.Module, *, stage: int, generation: int, index: int = 0, age: int = 1) -> None:
        """Send the weights of ``module`` (stage ``stage``) at evaluation ``index`` of ``generation``.

        Index 0 opens a generation (a new frontmost stage) with a pickled CPU copy of the module; later
        indices send its state_dict in shared memory.

        Args:
            module: The stage's module.
            stage: The stage's index.
            generation: The generation (one per frontmost stage).
            index: The evaluation's index in the generation.
            age: Readings compare snapshots this many apart.
        """
        if index == 0:
            try:
                payload = pickle.dumps(copy.deepcopy(module).to("cpu").requires_grad_(False).eval())
            except Exception as exc:
                raise ConfigError(f"stage {stage} ({type(module).__name__}) cannot be pickled for the reference "
                                  f"process: {exc}; define its modules at module level (no lambdas or "
                                  "closures)") from exc
            message = _refproc.Snapshot(generation, index, stage, age, payload=payload)
            self._pending.clear()  # older generations are of no use any more
        else:
            state = {k: to_shared(v) for k, v in module.state_dict().items()}
            message = _refproc.Snapshot(generation, index, stage, age, state=state)
        self._pending.append(message)
        while len(self._pending) > MAX_PENDING_SNAPSHOTS:
            opener = self._pending[0].payload is not None  # never drop the one that opens a generation
            del self._pending[1 if opener else 0]
            self.stats.snapshots_dropped += 1
        self._send_snapshots()

    def _send_snapshots(self) -> None:
        while self.state is ReferenceState.RUNNING and self._pending:
            try:
                self._inbox.put_nowait(self._pending[0])
            except queue.Full:
                return  # retried at the next poll or snapshot
            self._pending.popleft()
            self.stats.snapshots += 1

    def ready_for_probe(self) -> bool:
        """True if a probe may be captured now; else the skip is counted (queue full or CPU busy)."""
        if self.state is not ReferenceState.RUNNING:
            return False
        if self.stats.in_flight >= self.config.queue_size:
            self.stats.skipped_full += 1
            return False
        limit = self.config.max_cpu_percent
        if limit is not None:
            assert not isinstance(limit, str), "the worker's config has max_cpu_percent='auto' resolved"
            self.last_cpu_percent = self._cpu_percent()
            if self.last_cpu_percent > limit:
                self.stats.skipped_busy += 1
                if not self._warned_busy:
                    self._warned_busy = True
                    log.warning("actcache: reference evaluation skipped: CPU use %.0f%% > max_cpu_percent=%g; "
                                "plasticity readings wait for a quieter CPU (raise ReferenceConfig.max_cpu_percent "
                                "or set it to None on CPU-only training)", self.last_cpu_percent, limit)
                return False
        return True

    def submit(self, generation: int, index: int, step: int, inputs: State) -> bool:
        """Queue one probe (the stage's input) taken after snapshot ``index`` of ``generation``; never waits.

        Args:
            generation: The snapshot's generation.
            index: The snapshot's index.
            step: The training step the probe was taken at.
            inputs: The stage's input; it must not change afterwards: pass a ``to_shared`` copy.

        Returns:
            False if the probe was skipped.
        """
        if self.state is ReferenceState.RUNNING and self.stats.in_flight < self.config.queue_size:
            with contextlib.suppress(queue.Full):
                self._inbox.put_nowait(_refproc.Probe(generation, index, step, inputs))
                self.stats.submitted += 1
                return True
        self.stats.skipped_full += 1
        return False

    def poll(self, wait_s: float = 0.0) -> list[_refproc.Reading | _refproc.Built]:
        """Readings and build reports that arrived since the last call.

        Args:
            wait_s: Seconds to wait for the first (training passes 0 and never waits).
        """
        if self.state is not ReferenceState.RUNNING:
            return []
        out: list[_refproc.Reading | _refproc.Built] = []
        while True:
            try:
                message = self._outbox.get(timeout=wait_s) if wait_s > 0 else self._outbox.get_nowait()
            except queue.Empty:
                break
            wait_s = 0.0  # only the first message is waited for
            if isinstance(message, _refproc.Failed):
                self._fail(f"the reference process failed:\n{message.traceback}")
            if isinstance(message, _refproc.Built):  # a stage's first build
                self.stats.builds.append(dataclasses.asdict(message))
            else:  # exactly one Reading or Dropped per probe
                self.stats.answered += 1
                if isinstance(message, _refproc.Dropped):
                    self.stats.dropped += 1
                    continue
                self.stats.readings += 1
            out.append(message)
        if self._process.exitcode is not None:
            self._fail(f"the reference process exited unexpectedly with code {self._process.exitcode}")
        self._send_snapshots()
        return out

    def _fail(self, message: str) -> None:
        self.state = ReferenceState.FAILED
        self._process.join(timeout=1.0)
        raise ReferenceModelFailed(message)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the process: ask, wait, then terminate. Idempotent.

        Args:
            timeout_s: How long to wait before terminating.
        """
        if self._process is not None and self.state is not ReferenceState.CLOSED:
            if self._process.exitcode is None:
                with contextlib.suppress(queue.Full):  # a full inbox: the join below times out and terminates
                    self._inbox.put(_refproc.Stop(), timeout=timeout_s)
                self._process.join(timeout=timeout_s)
                if self._process.exitcode is None:
                    self._process.terminate()
                    self._process.join(timeout=timeout_s)
            for q in (self._inbox, self._outbox):
                q.cancel_join_thread()  # unread messages must not keep this process from exiting
                q.close()
        self.state = ReferenceState.CLOSED


class PlasticityProbe:
    """Rank 0's side of Egeria's plasticity: a snapshot per evaluation, one probe per interval.

    One evaluation interval (n = eval_every steps); nothing here waits::

        evaluation k   -> interval_done(): start the reference process once the policy has left
                          bootstrapping (snapshot 0), else send snapshot k of the frontmost stage
        step k*n + 1   -> a tap armed by arm() (once snapshot k - age exists, the queue has room and
                          the CPU is not busy; else the probe is skipped, counted) copies the frontmost
                          stage's input; step() sends it to the reference process, tagged k
        evaluation k+1 -> reading(): the latest plasticity reading of the current stage, if one arrived
        depth change   -> a new generation: the old stage's readings are ignored; snapshot 0 of the new one

    Args:
        cached: The cached forward whose frontmost active stage is probed.
        policy: The policy (its ``bootstrapping`` delays the reference process).
        config: How the reference model is built and run.
        timeline: Where the reference's build reports are written.
    """

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

    def _head_only(self) -> bool:
        return self.cached.frozen >= self.cached.model.num_stages - 1  # nothing left to judge

    def step(self, step: int) -> None:
        """Send the probe captured in this step's forward, if any.

        Args:
            step: The training step.
        """
        if self._capture_index is not None and self._inputs is not None:
            self.worker.submit(self._generation, self._capture_index, step, self._inputs)
            self._capture_index, self._inputs = None, None

    def arm(self) -> None:
        """Capture the next training forward, once per interval, if a reading can come of it."""
        if self._probed or self._capture_index is not None or self._head_only() or self._index < self._age:
            return
        self._probed = True
        if self.worker.ready_for_probe():
            self._capture_index = self._index
            self.cached.tap_training_input(self._take)

    def _take(self, state: Any) -> None:
        self._inputs = to_shared(state, self.worker.config.max_samples)

    def reading(self, step: int) -> _refproc.Reading | None:
        """The latest reading of the current frontmost stage that arrived since the last call.

        Args:
            step: The training step (for the timeline's build reports).
        """
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
        if self.worker.state is ReferenceState.RUNNING:
            self._snapshot()

    def depth_changed(self) -> None:
        """The frontmost stage changed: old readings are void, the new stage starts a generation."""
        self._generation += 1
        self._index = -1
        self._drop_capture()
        if self.worker.state is ReferenceState.RUNNING and not self._head_only():
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
