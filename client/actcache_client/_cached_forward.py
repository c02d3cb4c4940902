"""The training step's forward pass with the frozen prefix served from the cache.

For a batch ``(ids, inputs)``, frozen depth k and cache depth j <= k (j = k
unless a cost-model plan chose a shallower, smaller entry):

1. samples in the cached subset (all, unless the plan caches a fraction)
   are served at depth j by the daemon's stream of the epoch's order
   (actcache_client._stream; ``Get`` only when no stream serves the batch),
   collated into (pinned) host memory and staged to the device;
2. misses are seeded from a shallower frozen depth when its entries exist,
   else stages[0:j] run on the raw inputs; what was computed is put
   asynchronously; then stages[j:k] run on all of them;
3. samples outside the subset run stages[0:k] directly;
4. the parts are merged back in batch order and stages[k:] run with grad.

Hits are audited (actcache_client._audit): a small deterministic share is
recomputed and compared; a mismatch drops the fingerprint's entries in the
daemon, warns (CacheMismatchWarning) and recomputes, or raises
CacheMismatchError in strict mode.

Generations: when a fingerprint this process wrote can no longer be served
(its prefix was unfrozen and trained further), its entries are dropped in
the daemon at the next ``set_frozen``, unless ``keep_generations=True``.

Everything before step 4 runs under ``no_grad`` with the frozen stages in
eval mode. With no connection (or uncacheable data, or a RECOMPUTE plan) the
prefix is computed every step, so a run with and without the cache is the
same computation.

One class of about 580 lines: the step's stream, seeds, misses, audits and freezing share its epoch state.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import fields
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from actcache.codec import Encoding
from actcache.errors import CacheMismatchError, ConfigError, ConfigTypeError, InvalidRequest
from actcache.shm import SlotRun
from actcache_client._audit import AuditConfig, Auditor, same_entry, tolerances, warn_mismatch
from actcache_client._batch import Batch
from actcache_client._codec_choice import AutoEncoding, EncodingChoice, choose_encoding
from actcache_client._connection import Connection
from actcache_client.cost_model import Plan, PlanMode, cached_subset
from actcache_client._counters import EpochCounters, StepTimes
from actcache_client._fingerprint import cache_fingerprints, prefix_fingerprints
from actcache_client._planner import CachePlanner
from actcache_client._rows import RawInputs, merge
from actcache_client._stages import StagedModel, State, Suffix
from actcache_client._staging import Stager
from actcache_client._stream import EpochStream, cached_batches
from actcache_client._tensors import VarLen, collate_entries, encode_samples, run_layout, split_rows

__all__ = ["CachedForward", "EpochCounters", "StepTimes"]  # the counters are re-exported from actcache_client._counters

log = logging.getLogger("actcache_client")


class CachedForward:
    """Runs a StagedModel whose first ``frozen`` stages are served from the cache.

    ``set_frozen(k)`` freezes stages[:k] (``requires_grad=False``, eval mode)
    and computes their fingerprints once; unfreezing restores gradients and
    the model's train/eval mode. Call it instead of the model with a
    CachedLoader batch, ``logits = cached(batch)``, or with every row's
    inputs, ``cached(ids, inputs, variant=v)``. With a ``planner``, a cost
    model decides whether and where to cache. ``stream=False`` reads entries
    with ``Get`` instead of the daemon's stream of the pushed order.

    The fingerprints in cache keys cover the frozen weights and the data
    (``bind_data``, called by CachedLoader with the dataset's fingerprint).
    ``audit`` (an AuditConfig, default on; False: off) recomputes a share of
    hits to catch what no key can see. ``keep_generations=True`` keeps the
    entries of superseded fingerprints in the daemon. ``store_dtype``
    (torch.float16 or torch.bfloat16) stores the prefix's floating-point
    outputs in 16 bits (half the bytes to store, read and decode) and casts
    them back when served: not the default, since served activations are then
    rounded (a run is no longer bit-identical to one without the cache).
    ``encoding`` says how the daemon stores the entries: ``"auto"`` (an
    AutoEncoding with its defaults) picks raw, lz4 or zstd per (fingerprint,
    depth) from the first entries written (actcache_client._codec_choice says
    how) and records it in the plan; ``"daemon"`` leaves it to the daemon's
    ``--encoding``; ``"raw"``, ``"lz4"``, ``"zstd"``, ``"zstd:LEVEL"`` fix it.

    ``set_suffix_wrapper(fn)`` runs the active stages through ``fn(Suffix)``
    (e.g. a DistributedDataParallel wrapper), rebuilt at every ``set_frozen``
    so the wrapper always covers exactly the active stages.
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
        self.encoding = _check_encoding(encoding)
        self._encodings: dict[bytes, EncodingChoice] = {}  # fingerprint -> codec chosen (the writer thread's)
        self.planner = planner
        self.enabled = connection is not None
        self.disabled_reason = "" if connection is not None else "no connection"
        self.times = StepTimes()
        device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
        self.stager = Stager(device)
        self._frozen = 0
        self._frozen_modules: list[nn.Module] = []  # every module of the frozen stages (kept in eval mode)
        if store_dtype not in (None, torch.float16, torch.bfloat16):
            raise ConfigError(f"store_dtype must be torch.float16, torch.bfloat16 or None, got {store_dtype}")
        self.store_dtype = store_dtype
        # Entries stored in 16 bits are another computation's: their keys differ from full-precision ones.
        self._key_tag = b"" if store_dtype is None else f"store:{store_dtype}".encode()
        self._compute_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self._data = b""  # the data fingerprint folded into cache keys (empty: unknown)
        self._weights: list[bytes] = prefix_fingerprints(list(model.stages), 0)
        self._fingerprints: list[bytes] = self._keyed(self._weights, self._data)
        self._auditor: Auditor | None = None
        self.set_audit(audit)
        self._audited_opens = 0  # connection.opens when the auditor last restarted
        self._target: tuple[bytes, int] | None = None
        self.keep_generations = keep_generations
        self._generations: dict[bytes, tuple[int, bytes]] = {}  # fingerprint written -> (depth, data fingerprint)
        self._seed_depths: list[int] = []  # frozen depths whose entries may seed deeper ones
        # On CUDA the step leaves the interpreter idle while the GPU works: frames are received ahead then.
        self._stream = EpochStream(connection, rank=_rank(), receive_ahead=self.stager.device.type == "cuda") \
            if connection is not None and stream else None
        self._epoch: tuple[list[list[int]], int] | None = None  # this epoch's batches (sample ids) and variant
        self._position = 0  # the epoch position of the next batch the step runs
        self._epoch_misses = 0  # samples of the cached subset that missed this epoch
        self._skip_loads = False  # the loader can skip loading inputs (its dataset has targets)
        self._skips: dict[int, frozenset[int]] = {}  # epoch position -> sample ids the loader need not load
        self._epoch_marks: list[tuple[int, StepTimes, dict[str, float] | None]] = []  # counters at each epoch start
        self._probed = False  # a read-speed probe was sent this epoch
        self._written: dict[bytes, set[int]] = {}  # fingerprint -> sample ids stored (or found) under it
        self._prefix_done: float | None = None  # when the last prefix finished (for the step period)
        self._connection_seen = (0, 0.0, 0, 0.0)
        self._suffix_wrapper: Callable[[Suffix], nn.Module] | None = None
        self._suffix: nn.Module | None = None

    # ---- freezing and planning ---------------------------------------------

    @property
    def frozen(self) -> int:
        return self._frozen

    @property
    def plan(self) -> Plan | None:
        return self.planner.current if self.planner is not None else None

    def fingerprint(self, depth: int | None = None) -> bytes:
        """The fingerprint cache keys carry for stages[:depth] (default: the frozen prefix): weights and data."""
        return self._fingerprints[self._frozen if depth is None else depth]

    def set_audit(self, audit: AuditConfig | bool) -> None:
        """Audit served hits per ``audit`` (True: the default AuditConfig; False: no audits)."""
        config = AuditConfig() if audit is True else audit
        self._auditor = Auditor(config) if config else None

    def weights_fingerprint(self, depth: int | None = None) -> bytes:
        """Fingerprint of the weights of stages[:depth] alone (default: the frozen prefix)."""
        return self._weights[self._frozen if depth is None else depth]

    def bind_data(self, data: bytes, name: str = "") -> None:
        """Key entries by this data fingerprint from now on (actcache_client._identity; CachedLoader calls it).

        ``name`` (the dataset's ``data_id``, else the fingerprint) is how the daemon lists this job's data.
        """
        if self.connection is not None:
            self.connection.describe(data_id=name or data.hex()[:16])
        if data == self._data:
            return
        self._data = data
        self._fingerprints = self._keyed(self._weights, data)
        self._seed_depths = []  # seeds were entries of the other data
        self._retarget()

    def set_frozen(self, depth: int) -> None:
        """Freeze stages[:depth] and unfreeze the rest; the last stage always trains."""
        stages = list(self.model.stages)
        if not 0 <= depth < len(stages):
            raise ConfigError(f"set_frozen depth must be in 0..{len(stages) - 1} (the head always trains), got {depth}")
        old, old_fps = self._frozen, self._fingerprints
        for i, stage in enumerate(stages):
            stage.requires_grad_(i >= depth)
            stage.train(self.model.training if i >= depth else False)
        deepest = max([depth, *(d for d, _ in self._generations.values())])
        weights = prefix_fingerprints(stages, deepest)
        self._drop_superseded(weights)
        self._weights = weights[: depth + 1]
        self._fingerprints = self._keyed(self._weights, self._data)
        # Depths still frozen with unchanged weights keep their entries as seeds.
        candidates = set(self._seed_depths) | ({old} if old else set())
        self._seed_depths = sorted(
            (d for d in candidates if 0 < d <= depth and d < len(old_fps) and old_fps[d] == self._fingerprints[d]),
            reverse=True,
        )
        self._frozen = depth
        self._frozen_modules = [m for stage in stages[:depth] for m in stage.modules()]
        if self.planner is not None:
            for d in range(1, depth + 1):
                self.planner.set_written(d, len(self._written.get(self._fingerprints[d], ())))
            if depth:
                self.planner.plan_for(depth)
        self._retarget()
        self._rewrap()

    # ---- the active suffix -------------------------------------------------

    @property
    def suffix_module(self) -> nn.Module | None:
        """The wrapped active stages, or None when they run unwrapped."""
        return self._suffix

    def set_suffix_wrapper(self, wrapper: Callable[[Suffix], nn.Module] | None) -> None:
        """Run the active stages as ``wrapper(model.suffix(frozen))``; None runs them directly."""
        self._suffix_wrapper = wrapper
        self._rewrap()

    def _rewrap(self) -> None:
        self._suffix = None  # drop the old wrapper (and its DDP buckets) before building the new one
        if self._suffix_wrapper is not None:
            self._suffix = self._suffix_wrapper(self.model.suffix(self._frozen))

    def _cache_target(self) -> tuple[int, float] | None:
        """(cache depth j, cached fraction), or None when nothing is looked up or stored."""
        k = self._frozen
        if k == 0 or not self.enabled:
            return None
        if self.planner is None:
            return k, 1.0
        current = self.planner.current
        if current is None:  # not measured yet: this pass computes the prefix anyway, so keep what it computes
            return k, 1.0
        if current.mode is PlanMode.RECOMPUTE:
            return None
        return current.cache_depth, current.cached_fraction

    def _keyed(self, weights: list[bytes], data: bytes) -> list[bytes]:
        """The fingerprints cache keys carry: weights, data, and the stored precision."""
        return cache_fingerprints(weights, data + self._key_tag)

    def _drop_superseded(self, weights: list[bytes]) -> None:
        """Drop the entries of fingerprints this process wrote whose prefix weights have changed since."""
        for fingerprint, (depth, data) in list(self._generations.items()):
            if self._keyed([weights[depth]], data)[0] == fingerprint:
                continue
            del self._generations[fingerprint]
            self._written.pop(fingerprint, None)
            if self.connection is not None and not self.keep_generations:
                self.connection.drop(fingerprint)

    def _retarget(self) -> None:
        target = self._cache_target()
        key = None if target is None else (self._fingerprints[target[0]], target[0])
        if key != self._target and self._auditor is not None:
            self._auditor.restart()
        self._target = key
        if self._stream is None or self._epoch is None:
            return
        if target is None:
            self._stream.close()
        elif not self._stream.serves(key[0], key[1], target[1], self._epoch[1]):
            # A new target mid-epoch: the rest of the epoch is pushed again from the current batch.
            self._stream.push(key[0], key[1], target[1], self._epoch[1], self._epoch[0][self._position:], self._position)
        else:
            return
        self._plan_skips()

    def begin_epoch(
        self, batches: Sequence[Sequence[int]], variant: int, start: int = 0, epoch: int = 0, data: bytes | None = None,
        skip_loads: bool = False,
    ) -> None:
        """Called by CachedLoader with this rank's batches for the epoch (from batch ``start`` on) and its data.

        ``skip_loads``: the loader can leave out the inputs of samples the cache will serve (``skipped``).
        """
        self._epoch, self._skips, self._skip_loads = None, {}, skip_loads  # retargets below push nothing
        self._epoch_marks.append((epoch, copy.copy(self.times), self._connection_counts()))
        if data is not None:
            self.bind_data(data)
        if self.planner is not None and batches:
            self._probed = False
            self.planner.begin_epoch(epoch, sum(len(b) for b in batches), len(batches[0]))
            if self._frozen:
                self.planner.plan_for(self._frozen)
                self._retarget()
        batches = [list(b) for b in batches]
        self._epoch, self._position, self._epoch_misses = (batches, variant), start, 0
        target = self._cache_target()
        if self._stream is None or target is None:
            return
        fingerprint, fraction = self._fingerprints[target[0]], target[1]
        if not (start == 0 and self._stream.adopt_next(fingerprint, target[0], fraction, variant, batches)):
            # Entries the last epoch stored must be in the daemon before it looks them up for this one.
            self.connection.flush(timeout_s=self.connection.config.timeout_s)
            self._stream.push(fingerprint, target[0], fraction, variant, batches[start:], start)
        self._plan_skips()

    def epoch_counters(self) -> list[EpochCounters]:
        """Per epoch (from each CachedLoader epoch start to the next, the last one until now): the
        StepTimes and ClientStats counts it added. Resetting ``times`` mid-run makes these meaningless."""
        marks = [*self._epoch_marks, (None, self.times, self._connection_counts())]
        out = []
        for (epoch, times, entries), (_, later_times, later_entries) in zip(marks, marks[1:]):
            delta = None if entries is None else {k: later_entries[k] - v for k, v in entries.items()}
            out.append(EpochCounters(epoch, later_times.since(times), delta))
        return out

    def _connection_counts(self) -> dict[str, float] | None:
        if self.connection is None:
            return None
        stats = self.connection.stats
        return {f.name: getattr(stats, f.name) for f in fields(stats) if f.name != "fallbacks"}

    def skipped(self, position: int) -> frozenset[int]:
        """Sample ids of epoch batch ``position`` whose inputs the loader need not load (the cache has them)."""
        return self._skips.get(position, frozenset())

    def _plan_skips(self) -> None:
        """Ask the daemon which samples of the rest of the epoch are stored at the cache target: the
        loader skips their inputs, except for those the auditor picks (they are recomputed)."""
        self._skips = {}
        target = self._cache_target()
        if not self._skip_loads or self._epoch is None or target is None or self._stream is None:
            return
        (j, fraction), (batches, variant) = target, self._epoch
        subset = cached_batches(batches[self._position:], fraction)
        ids = [s for b in subset for s in b]
        present = None  # the push answered which entries are stored; else ask
        if self._stream.serves(self._fingerprints[j], j, fraction, variant):
            present = self._stream.stored_from(self._position)
        if present is None or len(present) != len(ids):
            present = self.connection.contains(self._fingerprints[j], j, ids, variant)
        if present is None:
            return
        flags = iter(present)
        if self._auditor is not None:
            self._sync_auditor()
        for position, ids in enumerate(subset, start=self._position):
            stored = [s for s in ids if next(flags)]
            audited = {stored[p] for p in self._auditor.choose(len(stored))} if self._auditor is not None else set()
            self._skips[position] = frozenset(s for s in stored if s not in audited)

    def prepare_next_epoch(self, batches: Sequence[Sequence[int]], variant: int) -> None:
        """Called by CachedLoader during an epoch with the next epoch's batches: push them ahead.

        Only after an epoch served without misses so far, so the daemon does not read ahead
        entries that are still being stored; a miss later in the epoch discards it.
        """
        target = self._cache_target()
        if self._stream is None or target is None or self._epoch_misses:
            return
        self._stream.push_next(self._fingerprints[target[0]], target[0], target[1], variant, [list(b) for b in batches])

    def disable(self, reason: str) -> None:
        """Stop using the cache (recompute every step), e.g. for uncacheable data."""
        self.enabled = False
        self.disabled_reason = reason
        self._retarget()

    # ---- the step ----------------------------------------------------------

    def __call__(self, batch: "Batch | Tensor | Sequence[int]", inputs: State | None = None, *, variant: int = 0) -> State:
        """Full forward pass: the frozen prefix (cached or computed) then the active suffix with grad.

        ``model(batch)`` takes a CachedLoader Batch (its input is ``batch.data[0]``, possibly only
        the rows the loader loaded); ``model(ids, inputs, variant=v)`` takes every row's input.
        """
        state = self.prefix(batch, inputs, variant=variant)
        t1 = time.perf_counter()
        out = self.model.run(state, self._frozen) if self._suffix is None else self._suffix(state)
        self.times.suffix_forward += time.perf_counter() - t1
        self.times.steps += 1
        return out

    def prefix(self, batch: "Batch | Tensor | Sequence[int]", inputs: State | None = None, *, variant: int = 0) -> State:
        """The state after the frozen stages for this batch (no grad); arguments as for calling the model."""
        start = time.perf_counter()
        if isinstance(batch, Batch):
            ids, variant = batch.ids, batch.variant
            loaded = None if batch.loaded is None else batch.loaded.tolist()
            raw = RawInputs(batch.data[0], len(ids), loaded, batch.load, self.stager.device)
        else:
            ids, raw = batch, RawInputs(inputs, len(batch), None, None, self.stager.device)
        id_list = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        if self.planner is not None and self._prefix_done is not None:
            self.planner.record_suffix(start - self._prefix_done, len(id_list))
        position = None  # this batch's epoch position, if it is the one the stream serves next
        if self._epoch is not None and self._position < len(self._epoch[0]) and self._epoch[0][self._position] == id_list:
            position = self._position
            self._position += 1
        state = self._prefix(id_list, raw, variant, position)
        self.times.raw_loaded += raw.count()
        self._prefix_done = time.perf_counter()
        if self.planner is not None:
            self._observe_connection()
            if self._frozen and self.planner.needs_replan(self._frozen):
                self.planner.plan_for(self._frozen)
                self._retarget()
        return state

    def _prefix(self, id_list: list[int], raw: RawInputs, variant: int, position: int | None) -> State:
        k = self._frozen
        every = list(range(len(id_list)))
        if k == 0:
            return raw.rows(every)
        if any(m.training for m in self._frozen_modules):  # a user's net.train() must not train frozen stages
            for stage in self.model.stages[:k]:
                stage.train(False)
        self.times.prefix_samples += len(id_list)
        target = self._cache_target()
        if target is None:
            self.times.computed_samples += len(id_list)
            return self._compute(raw.rows(every), 0, k)
        self.connection.surface()
        j, fraction = target
        rows = list(range(len(id_list))) if fraction >= 1.0 else [
            i for i, s in enumerate(id_list) if cached_subset(s, fraction)]
        parts: list[tuple[list[int], State]] = []
        if rows:
            at_j = self._state_at(j, [id_list[i] for i in rows], rows, raw, variant, position)
            parts.append((rows, self._compute(at_j, j, k) if j < k else at_j))
        direct = [i for i in range(len(id_list)) if i not in set(rows)] if len(rows) < len(id_list) else []
        if direct:
            parts.append((direct, self._compute(raw.rows(direct), 0, k)))
            self.times.computed_samples += len(direct)
        return parts[0][1] if len(parts) == 1 else merge(len(id_list), parts, self.varlen)

    def _state_at(self, j: int, ids: list[int], rows: list[int], raw: RawInputs, variant: int,
                  position: int | None) -> State:
        """States at depth j of the batch rows ``rows`` (sample ids ``ids``): hits, seeded, computed."""
        t0 = time.perf_counter()
        values = self._stream.take(position, ids) if self._stream is not None and position is not None else None
        streamed = values is not None  # Fetch verified every entry it served
        if values is None:
            values = self._lookup(self._fingerprints[j], j, ids, variant)
        self.times.fetch_wait += time.perf_counter() - t0
        found = [i for i, v in enumerate(values) if v is not None]
        if found and self._auditor is not None and not self._audit(j, rows, raw, values, found):
            values, found = [None] * len(ids), []
        parts: list[tuple[list[int], State]] = []
        if found:
            run = self._stream.run if streamed and len(found) == len(ids) else None
            parts.append((found, self._collate([values[i] for i in found], verify=not streamed, run=run)))
            self.times.cached_samples += len(found)
            self._mark_written(j, [ids[i] for i in found])
        missing = [i for i, v in enumerate(values) if v is None]
        for depth in (d for d in self._seed_depths if d < j):
            if not missing:
                break
            seeds = self._lookup(self._fingerprints[depth], depth, [ids[i] for i in missing], variant)
            hit = [i for i, v in zip(missing, seeds) if v is not None]
            if hit:
                seeded = self._compute(self._collate([v for v in seeds if v is not None]), depth, j)
                self._store(j, [ids[i] for i in hit], variant, seeded)
                parts.append((hit, seeded))
                self.times.seeded_samples += len(hit)
                missing = [i for i in missing if i not in set(hit)]
        self._epoch_misses += len(missing)
        if missing and self._stream is not None:
            self._stream.discard_next()  # pushed before these misses were stored: push it again at its start
        if missing:
            computed = self._compute(raw.rows([rows[i] for i in missing]), 0, j)
            self._store(j, [ids[i] for i in missing], variant, computed)
            parts.append((missing, computed))
            self.times.computed_samples += len(missing)
        return parts[0][1] if len(parts) == 1 else merge(len(ids), parts, self.varlen)

    # ---- helpers -----------------------------------------------------------

    def _lookup(self, fingerprint: bytes, depth: int, ids: list[int], variant: int) -> list:
        """Entries by ``Get`` (None per miss): seeds, and batches no stream serves."""
        values = self.connection.lookup(fingerprint, depth, ids, [variant] * len(ids))
        return values if values is not None else [None] * len(ids)

    def _collate(self, entries: list, *, verify: bool = True, run: SlotRun | None = None) -> State:
        t0 = time.perf_counter()
        on_gpu = run is not None and self.varlen is None and self.stager.cuda
        moved = self._ring_to_device(run, len(entries)) if on_gpu else None
        host = None if moved is not None else collate_entries(entries, varlen=self.varlen, alloc=self.stager.allocator(),
                                                              verify=verify, run=run)
        if self.planner is not None:
            self.planner.record_decode(sum(len(e) for e in entries), time.perf_counter() - t0)
        if moved is None:
            moved = self.stager.to_device(host)
        if self.planner is not None:
            for nbytes, seconds in self.stager.copy_readings():
                self.planner.record_h2d(nbytes, seconds)
        if self.store_dtype is not None:  # back to the precision the stages compute in (on the device: half the copy)
            moved = _cast(moved, self.store_dtype, self._compute_dtype)
        return moved

    def _ring_to_device(self, run: SlotRun, count: int) -> State | None:
        """A streamed batch copied to the GPU straight out of the shared-memory ring (None: collate it)."""
        header = run_layout(run, count)
        staged = self.stager.ring_to_device(run, count) if header is not None else None
        if staged is None:
            return None
        rows, done = staged
        self._stream.hold(done)
        return split_rows(rows, header)

    def _audit(self, j: int, rows: list[int], raw: RawInputs, values: list, found: list[int]) -> bool:
        """Recompute the hits the auditor picks; False (after dropping the fingerprint) if one differs.

        When the loader skipped inputs, the auditor chose at the epoch's start (``_plan_skips``) and
        the hits whose input was loaded anyway are the ones audited.
        """
        self._sync_auditor()
        if raw.partial:
            chosen = [i for i in found if raw.has(rows[i])]
        else:
            chosen = [found[p] for p in self._auditor.choose(len(found))]
        if not chosen:
            return True
        t0 = time.perf_counter()
        with torch.no_grad():
            computed = self.model.run(raw.rows([rows[i] for i in chosen]), 0, j)
        if self.store_dtype is not None:
            computed = _cast(computed, self._compute_dtype, self.store_dtype)
        entries = encode_samples(computed, varlen=self.varlen)
        tolerance = tolerances(self.stager.device)
        bad = sum(not same_entry(values[i], entry, tolerance) for i, entry in zip(chosen, entries))
        self.times.audit += time.perf_counter() - t0
        self.times.audited_samples += len(chosen)
        if not bad:
            return True
        fingerprint, namespace = self._fingerprints[j], self.connection.config.namespace
        self.connection.drop(fingerprint)
        self._written.pop(fingerprint, None)
        self._auditor.restart()
        if self.connection.config.strict:
            raise CacheMismatchError(
                f"{bad} of {len(chosen)} audited entries of namespace {namespace!r}, fingerprint "
                f"{fingerprint.hex()}, depth {j} differ from what the frozen prefix computes for them; "
                "their fingerprint's entries were dropped")
        warn_mismatch(namespace, fingerprint, j, bad)
        return False

    def _sync_auditor(self) -> None:
        """Restart the auditor after a (re)connection to the daemon, before it next chooses: its first
        hits are audited again (checked at the epoch's start too, where skipped loads are chosen)."""
        if self.connection.opens != self._audited_opens:
            self._audited_opens = self.connection.opens
            self._auditor.restart()

    def _compute(self, state: State, start: int, stop: int) -> State:
        t0 = time.perf_counter()
        with torch.no_grad():
            for index in range(start, stop):
                t = time.perf_counter()
                state = self.model.stages[index](state)
                if self.planner is not None:
                    tensors = state if isinstance(state, tuple) else (state,)
                    batch = max(len(tensors[0]), 1)
                    nbytes = sum(x.element_size() * x.numel() for x in tensors) / batch
                    self.planner.record_stage(index, time.perf_counter() - t, batch, nbytes)
        self.times.prefix += time.perf_counter() - t0
        return state

    def _mark_written(self, depth: int, ids: list[int]) -> None:
        written = self._written.setdefault(self._fingerprints[depth], set())
        written.update(ids)
        if self.planner is not None:
            self.planner.set_written(depth, len(written))

    def _store(self, depth: int, ids: list[int], variant: int, state: State) -> None:
        # A private copy: the suffix may modify its input in place (e.g. ReLU(inplace=True)).
        snapshot = tuple(t.detach().clone() for t in state) if isinstance(state, tuple) else state.detach().clone()
        if self.store_dtype is not None:
            snapshot = _cast(snapshot, self._compute_dtype, self.store_dtype)
        varlen = self.varlen
        self._mark_written(depth, ids)
        self._generations.setdefault(self._fingerprints[depth], (depth, self._data))
        # Without a read-speed measurement yet, read one put back (once per epoch until it is
        # measured): a slow disk then shows during the write epoch, before the cache is relied upon.
        probe = self.planner is not None and not self.planner.has_fetch_rate() and not self._probed
        self._probed = self._probed or probe
        self.connection.store(
            self._fingerprints[depth], depth, ids, [variant] * len(ids),
            lambda: encode_samples(snapshot, varlen=varlen), probe=probe, encoding=self._encoding_for(depth),
        )

    def encoding_choice(self, depth: int) -> EncodingChoice | None:
        """The codec ``encoding="auto"`` chose for the entries at ``depth`` (current weights), if any yet."""
        return self._encodings.get(self._fingerprints[depth])

    def _encoding_for(self, depth: int) -> Callable[[list[bytes]], str] | None:
        """How the daemon stores depth ``depth``'s entries; an AutoEncoding measures the first ones
        (on the connection's writer thread) and keeps its choice per fingerprint."""
        if not isinstance(self.encoding, AutoEncoding):
            return None if self.encoding == "daemon" else (lambda entries, fixed=self.encoding: fixed)
        fingerprint, config = self._fingerprints[depth], self.encoding
        samples = sum(len(b) for b in self._epoch[0]) if self._epoch is not None else None

        def choose(entries: list[bytes]) -> str:
            choice = self._encodings.get(fingerprint)
            if choice is None:
                try:
                    choice = choose_encoding(entries, samples=samples, config=config)
                except Exception as exc:  # a failed measurement must not stop the writes
                    choice = EncodingChoice("", f"the daemon's --encoding: measuring the codecs failed ({exc!r})", {})
                self._encodings[fingerprint] = choice
                if self.planner is not None:
                    self.planner.record_encoding(depth, choice)  # logs it with the plan
                else:
                    log.info("actcache encoding for depth %d: %s", depth, choice.reason)
            return choice.encoding

        return choose

    def _observe_connection(self) -> None:
        """Feed the planner the fetch and write throughput the connection measured since last time."""
        if self.connection is None:
            return
        s = self.connection.stats
        read, fetch_s, written, write_s = s.timed_bytes, s.timed_seconds, s.bytes_written, s.write_seconds
        r0, f0, w0, ws0 = self._connection_seen
        if fetch_s > f0:
            self.planner.record_fetch(read - r0, fetch_s - f0)
        if write_s > ws0:
            self.planner.record_write(written - w0, write_s - ws0)
        self._connection_seen = (read, fetch_s, written, write_s)


def _check_encoding(encoding: str | AutoEncoding) -> str | AutoEncoding:
    """``encoding`` as CachedForward keeps it: an AutoEncoding, "daemon" or a valid ``--encoding`` value."""
    if isinstance(encoding, AutoEncoding):
        return encoding
    if not isinstance(encoding, str):
        raise ConfigTypeError(f"encoding must be a str or an AutoEncoding, got {type(encoding).__name__} "
                              f"{encoding!r}")
    if encoding == "auto":
        return AutoEncoding()
    if encoding == "daemon":
        return encoding
    try:
        Encoding.parse(encoding)
    except InvalidRequest:
        raise ConfigError(f"encoding={encoding!r}: use 'auto' (or an AutoEncoding), 'daemon', 'raw', 'lz4', "
                          "'zstd' or 'zstd:LEVEL' (-7..22)") from None
    return encoding


def _cast(state: State, source: torch.dtype, target: torch.dtype) -> State:
    """``state`` with its ``source``-dtype tensors cast to ``target`` (masks and ids stay as they are)."""
    if isinstance(state, tuple):
        return tuple(t.to(target) if t.dtype == source else t for t in state)
    return state.to(target) if state.dtype == source else state


def _rank() -> int:
    """This process's rank when torch.distributed is initialized, else 0."""
    distributed = torch.distributed
    return distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0


