"""A batch's frozen-prefix output, assembled from where each row's comes from: served, seeded or computed.

For frozen depth k and cache target depth j <= k, rows in the cached subset are served at depth j (by the
epoch's stream, else ``Get``) and audited, or seeded from a shallower frozen depth, or computed and stored;
stages[j:k] then run on them all. Rows outside the subset run stages[0:k]. The parts are merged back in
batch order, all under ``no_grad``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from actcache.entries import ColumnRun
from actcache.shm import SlotRun
from actcache_client.cost_model import cached_subset
from actcache_client.engine._audit import HitAudit
from actcache_client.engine._counters import StepTimes
from actcache_client.engine._epoch_plan import EpochPlan, Target
from actcache_client.engine._frozen import FrozenPrefix, WrittenFingerprints
from actcache_client.engine._rows import RawInputs, merge
from actcache_client.engine._writer import EntryWriter
from actcache_client.transport._connection import connected
from actcache_client.transport._device_staging import Stager
from actcache_client.transport._state import State
from actcache_client.transport._tensors import (
    StorePrecision,
    VarLen,
    collate_entries,
    column_state,
    run_layout,
    split_rows,
)

if TYPE_CHECKING:
    from actcache_client.engine._planner import CachePlanner
    from actcache_client.transport._connection import Connection

__all__ = ["PrefixAssembly"]


@dataclass(eq=False, kw_only=True)
class PrefixAssembly:
    """Runs the frozen prefix of one batch (``run``), counting its samples and seconds in a StepTimes."""

    frozen: FrozenPrefix
    written: WrittenFingerprints
    connection: Connection | None
    planner: CachePlanner | None
    precision: StorePrecision
    varlen: VarLen | None
    stager: Stager
    epoch: EpochPlan
    audit: HitAudit
    writer: EntryWriter

    def run(self, ids: list[int], raw: RawInputs, variant: int, position: int | None, target: Target | None,
            times: StepTimes) -> State:
        """The state after the frozen stages for the batch ``ids`` (epoch ``position``, if the stream's)."""
        k, every = self.frozen.depth, list(range(len(ids)))
        if k == 0:
            return raw.rows(every)
        times.prefix_samples += len(ids)
        if target is None:
            times.computed_samples += len(ids)
            return self._compute(raw.rows(every), 0, k, times)
        connected(self.connection).surface()
        rows = every if target.fraction >= 1.0 else [i for i, s in enumerate(ids) if cached_subset(s, target.fraction)]
        parts: list[tuple[list[int], State]] = []
        if rows:
            at_j = self._state_at(target, [ids[i] for i in rows], rows, raw, variant, position, times)
            parts.append((rows, self._compute(at_j, target.depth, k, times) if target.depth < k else at_j))
        direct = [i for i in every if i not in set(rows)] if len(rows) < len(ids) else []
        if direct:
            parts.append((direct, self._compute(raw.rows(direct), 0, k, times)))
            times.computed_samples += len(direct)
        return merge(len(ids), parts, self.varlen)

    def _state_at(self, target: Target, ids: list[int], rows: list[int], raw: RawInputs, variant: int,
                  position: int | None, times: StepTimes) -> State:
        """States at the target depth of the batch rows ``rows`` (sample ids ``ids``): hits, seeded, computed."""
        j, fingerprint = target.depth, target.fingerprint
        t0 = time.perf_counter()
        stream = self.epoch.stream
        values = stream.take(position, ids) if stream is not None and position is not None else None
        streamed = values is not None  # Fetch verified every entry it served
        if values is None:
            values = self._lookup(fingerprint, j, ids, variant)
        times.fetch_wait += time.perf_counter() - t0
        found = [i for i, v in enumerate(values) if v is not None]
        if found and not self.audit.check(fingerprint, j, rows, raw, values, found, times):
            values, found = [None] * len(ids), []
        parts: list[tuple[list[int], State]] = []
        if found:
            whole = stream is not None and streamed and len(found) == len(ids)
            run = stream.run if whole and stream is not None else None
            columns = stream.columns if whole and stream is not None else None
            parts.append((found, self._collate([values[i] for i in found], raw, verify=not streamed, run=run,
                                               columns=columns)))
            times.cached_samples += len(found)
            self.written.mark(fingerprint, j, [ids[i] for i in found])
        missing = [i for i, v in enumerate(values) if v is None]
        for depth in (d for d in self.frozen.seed_depths if d < j):
            if not missing:
                break
            seeds = self._lookup(self.frozen.fingerprints[depth], depth, [ids[i] for i in missing], variant)
            hit = [i for i, v in zip(missing, seeds) if v is not None]
            if hit:
                seeded = self._compute(self._collate([v for v in seeds if v is not None], raw), depth, j, times)
                self.writer.store(j, [ids[i] for i in hit], variant, seeded)
                parts.append((hit, seeded))
                times.seeded_samples += len(hit)
                missing = [i for i in missing if i not in set(hit)]
        self.epoch.missed(len(missing))
        if missing:
            computed = self._compute(raw.rows([rows[i] for i in missing]), 0, j, times)
            self.writer.store(j, [ids[i] for i in missing], variant, computed)
            parts.append((missing, computed))
            times.computed_samples += len(missing)
        return merge(len(ids), parts, self.varlen)

    def _lookup(self, fingerprint: bytes, depth: int, ids: list[int], variant: int) -> list:
        """Entries by ``Get`` (None per miss): seeds, and batches no stream serves."""
        return connected(self.connection).lookup(fingerprint, depth, ids, [variant] * len(ids)) or [None] * len(ids)

    def _collate(self, entries: list, raw: RawInputs, *, verify: bool = True, run: SlotRun | None = None,
                 columns: ColumnRun | None = None) -> State:
        t0 = time.perf_counter()
        on_gpu = run is not None and self.varlen is None and self.stager.cuda
        moved = self._ring_to_device(run, len(entries)) if on_gpu and run is not None else None
        if moved is None and columns is not None and not verify and self.views_served:
            moved = self._in_ring(columns)
        if moved is None:
            host = collate_entries(entries, varlen=self.varlen, alloc=self.stager.allocator(), verify=verify,
                                   run=run, columns=columns, copy=self.stager.copier,
                                   length=raw.length() if self.varlen else None)
            decoded = time.perf_counter() - t0
            moved = self.stager.to_device(host)
        else:
            decoded = time.perf_counter() - t0
        if self.planner is not None:
            self.planner.record_decode(sum(len(e) for e in entries), decoded)
            for nbytes, seconds in self.stager.copy_readings():
                self.planner.record_h2d(nbytes, seconds)
        # back to the precision the stages compute in (on the device: half the copy)
        return self.precision.to_compute(moved)

    @property
    def views_served(self) -> bool:
        """Whether streamed batches are used where they lie in the ring: on the CPU, as stored (no padding
        to add, no cast), so that a copy would only move the same bytes."""
        return self.stager.device.type == "cpu" and self.varlen is None and self.precision.store_dtype is None

    def _in_ring(self, columns: ColumnRun) -> State:
        """A streamed batch as views of the ring's columns, held until the last tensor viewing them goes."""
        state, holder = column_state(columns)
        if holder is not None:
            columns.segment.hold(columns.position, holder)
        return state

    def _ring_to_device(self, run: SlotRun, count: int) -> State | None:
        """A streamed batch copied to the GPU straight out of the shared-memory ring (None: collate it)."""
        header = run_layout(run, count)
        staged = self.stager.ring_to_device(run, count) if header is not None else None
        if header is None or staged is None:
            return None
        rows, done = staged
        stream = self.epoch.stream
        assert stream is not None, "a run of ring slots comes from the stream"
        stream.hold(done)
        return split_rows(rows, header)

    def _compute(self, state: State, start: int, stop: int, times: StepTimes) -> State:
        """stages[start:stop] on ``state``; for the cost model, each stage timed as the device runs it
        (CUDA events: a launch returns before its kernels run), the reading taken once it is done."""
        t0, planner, clock = time.perf_counter(), self.planner, self.stager.clock
        with torch.no_grad():
            for index in range(start, stop):
                began = clock.start() if planner is not None else None
                state = self.frozen.model.stages[index](state)
                if planner is not None:
                    clock.stop(began, planner.stage_reading(index, state))
        times.prefix += time.perf_counter() - t0
        return state
