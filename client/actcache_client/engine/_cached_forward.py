"""The training step's forward pass with the frozen prefix served from the cache.

``CachedForward`` decides the cache target (the frozen depth, or what a cost-model plan chose), hands it
to its parts (_frozen, _epoch_plan, _assembly, _audit, _writer) and runs the active stages with grad on the
prefix's output, computed under ``no_grad`` with the frozen stages in eval mode. With no connection (or
uncacheable data, or a RECOMPUTE plan) the prefix is computed every step: the same computation.

What CachedLoader needs from a model it feeds is a ``LoaderModel``: its ``loader_side`` (a LoaderSide) takes
the loader's calls (the data's fingerprint, each epoch's order, the loads it may skip), kept apart from the
user's API (calling the model, ``set_frozen``, ``fingerprint``).
"""

from __future__ import annotations

import time
from dataclasses import fields
from functools import partial
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor, nn

from actcache.errors import ConfigTypeError
from actcache_client.cost_model import Plan, PlanMode
from actcache_client.engine._assembly import PrefixAssembly
from actcache_client.engine._audit import AuditConfig, HitAudit
from actcache_client.engine._batch import Batch
from actcache_client.engine._codec_choice import AutoEncoding, EncodingChoice
from actcache_client.engine._counters import EpochCounters, EpochLog, StepTimes
from actcache_client.engine._epoch_plan import EpochPlan, Target
from actcache_client.engine._frozen import FrozenPrefix, WrittenFingerprints
from actcache_client.engine._planner import CachePlanner
from actcache_client.engine._rows import RawInputs
from actcache_client.engine._writer import EntryWriter, check_encoding
from actcache_client.layouts._stages import StagedModel
from actcache_client.transport._connection import Connection
from actcache_client.transport._device_staging import CopyTimer, Stager
from actcache_client.transport._epoch_stream import EpochStream
from actcache_client.transport._state import State
from actcache_client.transport._tensors import StorePrecision, VarLen

__all__ = ["CachedForward", "EpochCounters", "ForwardLoaderSide", "InPlaceFill", "LoaderModel", "LoaderSide",
           "StepTimes"]  # re-exports the counters

_DRIFT_EVERY = 8  # steps between looks for a drifted measurement once a plan exists


class CachedForward:
    """Runs a StagedModel whose first ``frozen`` stages are served from the cache.

    ``set_frozen(k)`` freezes stages[:k] (``requires_grad=False``, eval mode)
    and computes their fingerprints once; unfreezing restores gradients and
    the model's train/eval mode. Call it instead of the model with a
    CachedLoader batch, ``logits = cached(batch)``, or with every row's
    inputs, ``cached(ids, inputs, variant=v)``.

    Args:
        model: The network, split into stages.
        connection: The daemon's connection; None: the cache is disabled ("no connection").
        varlen: The stages' outputs are ``(hidden, mask)`` states whose padding is not stored.
        device: The device inputs and served entries are moved to; default: the model parameters' (else the CPU).
        planner: a cost model that decides whether and where to cache.
        stream: False reads entries with ``Get`` instead of the daemon's stream of the pushed order.
        audit: an AuditConfig (default on; False: off): recompute a share of hits to catch what no key
            can see (cache keys cover the frozen weights and the data the loader binds).
        keep_generations: True keeps the entries of superseded fingerprints in the daemon.
        store_dtype: torch.float16 or torch.bfloat16 stores floating-point outputs in 16 bits (half the
            bytes to store, read and decode), cast back when served; served activations are then rounded.
        encoding: ``"auto"`` (an AutoEncoding with its defaults) picks raw, lz4 or zstd per (fingerprint,
            depth) from the first entries written and records it in the plan; ``"daemon"`` leaves it to
            the daemon's ``--encoding``; ``"raw"``, ``"lz4"``, ``"zstd"``, ``"zstd:LEVEL"`` fix it.

    ``set_suffix_wrapper(fn)`` runs the active stages through ``fn(model.suffix(frozen))`` (e.g. a
    DistributedDataParallel wrapper), rebuilt at every ``set_frozen``.

    ``loader_side`` takes CachedLoader's calls (a LoaderSide): the data, each epoch's order, the skipped loads.
    """

    def __init__(
        self,
        model: StagedModel,
        connection: Connection | None = None,
        *,
        varlen: VarLen | None = None,
        encoding: str | AutoEncoding = "auto",
        stream: bool = True,
        planner: CachePlanner | None = None,
        device: torch.device | str | None = None,
        audit: AuditConfig | bool = True,
        keep_generations: bool = False,
        store_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.connection = connection
        self.varlen = varlen
        encoding = check_encoding(encoding)
        self.planner = planner
        self.enabled = connection is not None
        self.disabled_reason = "" if connection is not None else "no connection"
        self.times = StepTimes()
        device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
        self.stager = Stager(device)
        compute_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        precision = StorePrecision(store_dtype, compute_dtype)
        self.store_dtype = store_dtype
        self.keep_generations = keep_generations
        self._frozen = FrozenPrefix(model, precision.key_tag)
        self._written = WrittenFingerprints(planner)
        self._audit = HitAudit(audit, model=model, connection=connection, written=self._written, precision=precision,
                               varlen=varlen, device=self.stager.device)
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # batches used where they lie in the ring (PrefixAssembly.views_served) come as columns
        columns = self.stager.device.type == "cpu" and varlen is None and store_dtype is None
        epoch_stream = EpochStream(connection, rank=rank, columns=columns) if connection is not None and stream else None
        self._epoch = EpochPlan(connection, epoch_stream, self._audit)
        self._writer = EntryWriter(frozen=self._frozen, written=self._written, connection=connection, planner=planner,
                                   precision=precision, varlen=varlen, encoding=encoding, epoch=self._epoch)
        self._assembly = PrefixAssembly(frozen=self._frozen, written=self._written, connection=connection,
                                        planner=planner, precision=precision, varlen=varlen, stager=self.stager,
                                        epoch=self._epoch, audit=self._audit, writer=self._writer)
        self._epoch_log = EpochLog()
        # The last step, for the planner: when its prefix began, its samples, what its prefix did (a StepKind),
        # and an event recorded on the device when its prefix was done (the rest of the step is timed from it).
        self._last_step: tuple[float, int, str | None, object | None] | None = None
        self._steps_planned = 0  # prefixes run with a planner
        self._suffix_wrapper: Callable[[StagedModel], nn.Module] | None = None
        self._suffix: nn.Module | None = None
        self._input_tap: Callable[[State], None] | None = None
        self.loader_side = ForwardLoaderSide(self)

    @property
    def frozen(self) -> int:
        return self._frozen.depth

    @property
    def plan(self) -> Plan | None:
        return self.planner.current if self.planner is not None else None

    @property
    def encoding(self) -> str | AutoEncoding:
        """How the daemon stores the entries (see the class docstring)."""
        return self._writer.encoding

    def fingerprint(self, depth: int | None = None) -> bytes:
        """The fingerprint cache keys carry for stages[:depth]: weights and data.

        Args:
            depth: The number of stages; default: the frozen prefix.
        """
        return self._frozen.fingerprints[self._frozen.depth if depth is None else depth]

    def set_audit(self, audit: AuditConfig | bool) -> None:
        """Audit served hits per ``audit``.

        Args:
            audit: An AuditConfig; True: the default AuditConfig; False: no audits.
        """
        self._audit.configure(audit)

    def weights_fingerprint(self, depth: int | None = None) -> bytes:
        """Fingerprint of the weights of stages[:depth] alone.

        Args:
            depth: The number of stages; default: the frozen prefix.
        """
        return self._frozen.weights[self._frozen.depth if depth is None else depth]

    def _bind_data(self, data: bytes, name: str = "") -> None:
        """Key entries by this data fingerprint from now on (CachedLoader calls it); ``name`` (the dataset's
        ``data_id``, else the fingerprint) is how the daemon lists this job's data."""
        if self.connection is not None:
            self.connection.describe(data_id=name or data.hex()[:16])
        if self._frozen.bind_data(data):
            self._retarget()

    def set_frozen(self, depth: int) -> None:
        """Freeze stages[:depth] and unfreeze the rest; the last stage always trains.

        Args:
            depth: The number of stages to freeze.
        """
        self._writer.release()  # the puts held go before the drops below
        weights = self._frozen.freeze(depth, self._written.deepest())
        for fingerprint in self._written.superseded(lambda d, data: self._frozen.keyed([weights[d]], data)[0]):
            if self.connection is not None and not self.keep_generations:
                self.connection.drop(fingerprint)
        if self.planner is not None:
            for d in range(1, depth + 1):
                self.planner.set_written(d, self._written.count(self._frozen.fingerprints[d]))
            if depth:
                self.planner.plan_for(depth)
        self._retarget()
        self._rewrap()

    def encoding_choice(self, depth: int) -> EncodingChoice | None:
        """The codec ``encoding="auto"`` chose for the entries at ``depth`` (current weights), if any yet.

        Args:
            depth: The number of stages whose output the entries hold.
        """
        return self._writer.choice(self._frozen.fingerprints[depth])

    @property
    def suffix_module(self) -> nn.Module | None:
        """The wrapped active stages, or None when they run unwrapped."""
        return self._suffix

    def set_suffix_wrapper(self, wrapper: Callable[[StagedModel], nn.Module] | None) -> None:
        """Run the active stages as ``wrapper(model.suffix(frozen))``, rebuilt at every ``set_frozen``.

        Args:
            wrapper: Wraps the active stages (e.g. in DistributedDataParallel); None runs them directly.
        """
        self._suffix_wrapper = wrapper
        self._rewrap()

    def _rewrap(self) -> None:
        self._suffix = None  # drop the old wrapper (and its DDP buckets) before building the new one
        if self._suffix_wrapper is not None:
            self._suffix = self._suffix_wrapper(self.model.suffix(self._frozen.depth))

    def _cache_target(self) -> Target | None:
        """Where entries are looked up and stored, or None when nothing is."""
        plan, k = self.plan, self._frozen.depth  # no plan yet: this pass computes the prefix anyway, so keep it
        if k == 0 or not self.enabled or (plan is not None and plan.mode is PlanMode.RECOMPUTE):
            return None
        depth, fraction = (k, 1.0) if plan is None or plan.cache_depth is None else (plan.cache_depth, plan.cached_fraction)
        return Target(self._frozen.fingerprints[depth], depth, fraction)

    def _retarget(self) -> None:
        target = self._cache_target()
        self._audit.retarget(None if target is None else (target.fingerprint, target.depth))
        self._epoch.retarget(target)

    def _disable(self, reason: str) -> None:
        """Stop using the cache (recompute every step), e.g. for uncacheable data."""
        self.enabled = False
        self.disabled_reason = reason
        self._retarget()

    def _begin_epoch(
        self, batches: Sequence[Sequence[int]], variant: int, start: int = 0, epoch: int = 0, data: bytes | None = None,
        skip_loads: bool = False,
    ) -> None:
        """Called by CachedLoader with this rank's batches for the epoch (from batch ``start`` on) and its data;
        ``skip_loads``: the loader can leave out the inputs of samples the cache will serve (``skipped``)."""
        self._epoch.reset(skip_loads)  # retargets below push nothing
        self._epoch_log.mark(epoch, self.times, self._connection_counts())
        if data is not None:
            self._bind_data(data)
        if self.planner is not None and batches:
            self._writer.new_epoch()
            self.planner.begin_epoch(epoch, sum(len(b) for b in batches), len(batches[0]))
            self._last_step = None  # the gap between epochs (evaluation, a checkpoint) is no step
            self._replan(self.planner, epoch_start=True)
        self._epoch.begin(batches, variant, start, self._cache_target())

    def _prepare_next_epoch(self, batches: Sequence[Sequence[int]], variant: int) -> None:
        """Called by CachedLoader during an epoch with the next epoch's batches: push them ahead, only while
        the epoch has no misses (the daemon must not read ahead entries still being stored)."""
        self._epoch.prepare_next(batches, variant, self._cache_target())

    def _skipped(self, position: int) -> frozenset[int]:
        """Sample ids of epoch batch ``position`` whose inputs the loader need not load (the cache has them)."""
        return self._epoch.skips.get(position, frozenset())

    def epoch_counters(self) -> list[EpochCounters]:
        """Per epoch (from each CachedLoader epoch start to the next, the last one until now): the
        StepTimes and ClientStats counts it added. Resetting ``times`` mid-run makes these meaningless."""
        return self._epoch_log.counters(self.times, self._connection_counts())

    def _connection_counts(self) -> dict[str, float] | None:
        if self.connection is None:
            return None
        stats = self.connection.stats
        return {f.name: getattr(stats, f.name) for f in fields(stats) if f.name != "fallbacks"}

    def __call__(self, batch: "Batch | Tensor | Sequence[int]", inputs: State | None = None, *, variant: int = 0) -> State:
        """Full forward pass: the frozen prefix (cached or computed) then the active suffix with grad.

        Args:
            batch: A CachedLoader Batch (``model(batch)``), or the batch's sample ids (``model(ids, inputs)``).
            inputs: Every row's input, with sample ids.
            variant: The augmented version of the samples, with sample ids.
        """
        state = self.prefix(batch, inputs, variant=variant)
        if self.model.training and torch.is_grad_enabled():
            self._training_input(state)
        t1 = time.perf_counter()
        out = self.model.run(state, self._frozen.depth) if self._suffix is None else self._suffix(state)
        self.times.suffix_forward += time.perf_counter() - t1
        self.times.steps += 1
        return out

    def tap_training_input(self, tap: Callable[[State], None] | None) -> None:
        """Give ``tap`` the input of the frontmost active stage in the next training forward, once.

        Args:
            tap: Called with that input; None cancels.
        """
        self._input_tap = tap

    def _training_input(self, state: State) -> None:
        """A training forward's input to the frontmost active stage: from ``__call__``, or from a network that
        serves the prefix in place (InPlacePrefix), whose own modules never call the stage adapters."""
        tap, self._input_tap = self._input_tap, None
        if tap is not None:
            tap(state)

    def prefix(self, batch: "Batch | Tensor | Sequence[int]", inputs: State | None = None, *, variant: int = 0) -> State:
        """The state after the frozen stages for this batch (no grad).

        Args:
            batch: A CachedLoader Batch, or the batch's sample ids (with ``inputs``).
            inputs: Every row's input, with sample ids.
            variant: The augmented version of the samples, with sample ids.

        Returns:
            The frozen stages' output, served from the cache or computed.

        Raises:
            ConfigTypeError: ``batch`` is a floating-point tensor (inputs, not sample ids) without ``inputs``.
        """
        start = time.perf_counter()
        if isinstance(batch, Tensor) and inputs is None and batch.is_floating_point():
            raise ConfigTypeError(
                f"CachedForward was called with a {tuple(batch.shape)} {batch.dtype} tensor; it needs the batch's sample "
                "ids: call it with a CachedLoader Batch, model(batch), or as model(ids, inputs) — or keep calling your "
                "own network and let ActCache(net) serve its frozen prefix")
        ids: Tensor | Sequence[int]
        if isinstance(batch, Batch):
            ids, variant = batch.ids, batch.variant
            loaded = None if batch.loaded is None else batch.loaded.tolist()
            raw = RawInputs(batch.data[0], len(ids), loaded, batch.load, self.stager.device)
        else:
            ids, raw = batch, RawInputs(inputs, len(batch), None, None, self.stager.device)
        id_list = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        if self.planner is not None:
            self._time_last_step(self.planner, start)
        position = self._epoch.advance(id_list)  # this batch's epoch position, if the stream serves it next
        target = self._cache_target()
        cached, computed = self.times.cached_samples, self.times.computed_samples
        state = self._assembly.run(id_list, raw, variant, position, target, self.times)
        self.times.raw_loaded += raw.count()
        if self.planner is not None:
            kind = _step_kind(len(id_list), self.times.cached_samples - cached,
                              self.times.computed_samples - computed, target is None)
            self._end_step(self.planner, start, len(id_list), kind, self.stager.clock.start())
        return state

    def recompute_in_place(self, batch: Batch) -> bool:
        """Whether the network's own modules are to compute training ``batch``'s frozen prefix, as they would
        without the cache: none of it is served or stored (a plan that recomputes, a disabled cache), nothing
        asks for its state, and the cost model does not time its stages in this step (it does every
        ``_DRIFT_EVERY`` steps). If so, the step is counted here."""
        n, planner = len(batch.ids), self.planner
        if (not self._frozen.depth or batch.loaded is not None or self._input_tap is not None
                or self._cache_target() is not None
                or (planner is not None and (self.plan is None or self._steps_planned % _DRIFT_EVERY == 0))):
            return False
        start = time.perf_counter()
        if planner is not None:
            self._time_last_step(planner, start)
        self._epoch.advance(batch.ids.tolist())  # a host tensor (Batch.ids): no device sync
        self.times.prefix_samples += n
        self.times.computed_samples += n
        self.times.raw_loaded += n
        if planner is not None:  # the suffix is not timed apart: the prefix runs in it
            self._end_step(planner, start, n, "recomputed", None)
        return True

    def fill_in_place(self, batch: Batch, *, timeable: bool) -> InPlaceFill | None:
        """Whether the network's own modules are to compute training ``batch``'s frozen prefix, to be stored as
        it comes out of them: a write epoch (none of the batch was stored when its order was pushed), every
        row cached at the frozen depth, and nothing else asks for its state. In the steps the cost model times
        (every ``_DRIFT_EVERY``), only if the caller can time each stage as the modules run (``timeable``).
        If so, the step is counted here; the InPlaceFill returned times the stages and stores the output."""
        n, planner, target, stream = len(batch.ids), self.planner, self._cache_target(), self._epoch.stream
        timed = planner is not None and (self.plan is None or self._steps_planned % _DRIFT_EVERY == 0)
        if (not self._frozen.depth or batch.loaded is not None or self._input_tap is not None or target is None
                or stream is None or target.depth != self._frozen.depth or target.fraction < 1.0
                or any(d < target.depth for d in self._frozen.seed_depths) or (timed and not timeable)):
            return None
        ids = batch.ids.tolist()  # a host tensor (Batch.ids): no device sync
        if not stream.take_absent(self._epoch.position, ids):
            return None
        start = time.perf_counter()
        if planner is not None:
            self._time_last_step(planner, start)
        position = self._epoch.advance(ids)
        assert position is not None, "take_absent() found the batch at the stream's position"
        self._epoch.missed(n)
        self.times.prefix_samples += n
        self.times.computed_samples += n
        self.times.raw_loaded += n
        if planner is not None:  # the suffix is timed from the prefix's end in timed steps (InPlaceFill)
            self._end_step(planner, start, n, None, None)
        writer, depth, variant = self._assembly.writer, target.depth, batch.variant
        store = partial(writer.store, depth, ids, variant)
        if not timed:
            return InPlaceFill(store)
        assert planner is not None
        return InPlaceFill(store, clock=self.stager.clock, planner=planner, on_done=self._prefix_done)

    def _prefix_done(self, reading: object) -> None:
        """The last step's prefix ended at clock ``reading``: the rest of the step is timed as its suffix."""
        assert self._last_step is not None
        start, samples, kind, _ = self._last_step
        self._last_step = (start, samples, kind, reading)

    def _end_step(self, planner: CachePlanner, start: float, samples: int, kind: str | None,
                  prefix_done: object | None) -> None:
        """Hand a step's prefix to ``planner``: the step, timed from ``start`` to the next one's (the rest after
        ``prefix_done``, a clock reading, timed as the suffix); every few steps, a look for drift."""
        self._last_step = (start, samples, kind, prefix_done)
        if self.connection is not None:
            planner.observe(self.connection.stats)
        self._steps_planned += 1
        # once planned, drift is looked for every few steps: a look builds every median (docs/design/step.md)
        if (self.plan is None or self._steps_planned % _DRIFT_EVERY == 0) and planner.needs_replan(self._frozen.depth):
            self._replan(planner)

    def _time_last_step(self, planner: CachePlanner, now: float) -> None:
        """Give the planner the last step's readings: its period (from its prefix's start to this one's, as
        the loop sees it), and the rest of the step after its prefix, timed on the device."""
        clock, last = self.stager.clock, self._last_step
        if last is not None:
            began, samples, kind, prefix_done = last
            if prefix_done is not None:
                clock.stop(prefix_done, partial(planner.record_suffix, samples=samples))
            if kind is not None:
                planner.record_step(now - began, samples, kind, self._frozen.depth)
        for record, seconds in clock.readings():
            record(seconds)

    def _replan(self, planner: CachePlanner, *, epoch_start: bool = False) -> None:
        if self._frozen.depth:
            if epoch_start:
                planner.check_measured(self._frozen.depth)
            planner.plan_for(self._frozen.depth)
            self._retarget()


class LoaderSide(Protocol):
    """The calls CachedLoader makes on each model it feeds."""

    def bind_data(self, data: bytes, name: str = "") -> None:
        """Key entries by this data fingerprint from now on; ``name`` is the dataset's ``data_id``."""

    def disable(self, reason: str) -> None:
        """Stop using the cache (recompute every step), e.g. for uncacheable data."""

    def begin_epoch(self, batches: Sequence[Sequence[int]], variant: int, start: int = 0, epoch: int = 0,
                    data: bytes | None = None, skip_loads: bool = False) -> None:
        """This rank's batches (sample ids) for the epoch, from batch ``start`` on, and its data; ``skip_loads``:
        the loader can leave out the inputs of samples the cache will serve (``skipped``)."""

    def prepare_next_epoch(self, batches: Sequence[Sequence[int]], variant: int) -> None:
        """The next epoch's batches, drawn during this one (pushed ahead when that is safe)."""

    def skipped(self, position: int) -> frozenset[int]:
        """Sample ids of epoch batch ``position`` whose inputs the loader need not load."""

    def steps_ended(self) -> None:
        """The loop asks for a batch, or stopped asking: no step is running."""


class LoaderModel(Protocol):
    """A model CachedLoader feeds (CachedForward, CachedTeacher): its ``loader_side`` takes the loader's calls."""

    @property
    def loader_side(self) -> LoaderSide: ...


class ForwardLoaderSide:
    """A CachedForward's LoaderSide: CachedLoader's calls, apart from the user's API; ``before_epoch`` runs
    first at each epoch start (a CachedTeacher checks its weights there)."""

    def __init__(self, forward: CachedForward, before_epoch: Callable[[], object] | None = None) -> None:
        self._forward = forward
        self._before_epoch = before_epoch

    def bind_data(self, data: bytes, name: str = "") -> None:
        self._forward._bind_data(data, name)

    def disable(self, reason: str) -> None:
        self._forward._disable(reason)

    def begin_epoch(self, batches: Sequence[Sequence[int]], variant: int, start: int = 0, epoch: int = 0,
                    data: bytes | None = None, skip_loads: bool = False) -> None:
        self._forward._writer.release()  # before a teacher's check may drop what they hold
        if self._before_epoch is not None:
            self._before_epoch()
        self._forward._begin_epoch(batches, variant, start, epoch=epoch, data=data, skip_loads=skip_loads)

    def prepare_next_epoch(self, batches: Sequence[Sequence[int]], variant: int) -> None:
        self._forward._prepare_next_epoch(batches, variant)

    def skipped(self, position: int) -> frozenset[int]:
        return self._forward._skipped(position)

    def steps_ended(self) -> None:
        self._forward._writer.steps_ended()


class InPlaceFill:
    """A write step whose frozen prefix the network's own modules compute (``CachedForward.fill_in_place``).

    The caller calls ``begin`` as the first frozen module is called, ``stage_done`` as each frozen stage's
    last module returns while the cost model times the step (``timed``: each stage timed as the device runs
    it, as the stage adapters would be), and ``store`` with the frozen prefix's output.
    """

    __slots__ = ("timed", "_store", "_clock", "_planner", "_on_done", "_began")

    def __init__(self, store: Callable[[State], None], *, clock: CopyTimer | None = None,
                 planner: CachePlanner | None = None, on_done: Callable[[object], None] | None = None) -> None:
        self.timed = planner is not None
        self._store, self._clock, self._planner, self._on_done = store, clock, planner, on_done
        self._began: object = None

    def begin(self) -> None:
        if self._clock is not None:
            self._began = self._clock.start()

    def stage_done(self, stage: int, output: State) -> None:
        assert self._clock is not None and self._planner is not None, "only a timed step times its stages"
        self._clock.stop(self._began, self._planner.stage_reading(stage, output))
        self._began = self._clock.start()

    def store(self, output: State) -> None:
        self._store(output)
        if self._on_done is not None and self._clock is not None:
            self._on_done(self._clock.start())


def _step_kind(samples: int, cached: int, computed: int, recomputing: bool) -> str | None:
    """What a step's prefix did, for the planner's measured check: every row served from the cache
    (``"served"``), every row recomputed under a plan that recomputes (``"recomputed"``), else None
    (a write epoch, partial caching, nothing frozen)."""
    if samples and cached == samples:
        return "served"
    if samples and recomputing and computed == samples:
        return "recomputed"
    return None
