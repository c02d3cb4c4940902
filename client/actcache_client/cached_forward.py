"""The training step's forward pass with the frozen prefix served from the cache.

For a batch ``(ids, inputs)`` and frozen depth k:

1. hits come from the daemon (looked up ahead of need when the loader told
   us the epoch's order), collated into (pinned) host memory and staged to
   the device;
2. misses are seeded from a shallower frozen depth j when its entries exist
   (stages j..k-1 run on them), else stages[0:k] run on the raw inputs, all
   under ``no_grad`` in eval mode; what was computed is put asynchronously;
3. the parts are merged back in batch order and stages[k:] run with grad.

With no connection (or when the dataset cannot be cached) the same code
computes the prefix every step, so a run with and without the cache is the
same computation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from actcache_client.connection import Connection
from actcache_client.fingerprint import prefix_fingerprints
from actcache_client.lookahead import Lookahead
from actcache_client.stages import StagedModel, State, Suffix
from actcache_client.staging import Stager
from actcache_client.tensors import VarLen, collate_entries, encode_samples

__all__ = ["CachedForward", "StepTimes"]


@dataclass
class StepTimes:
    """Seconds spent per part of the forward pass, accumulated."""

    fetch_wait: float = 0.0
    prefix: float = 0.0
    suffix_forward: float = 0.0
    steps: int = 0
    computed_samples: int = 0
    seeded_samples: int = 0
    cached_samples: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class CachedForward:
    """Runs a StagedModel whose first ``frozen`` stages are served from the cache.

    ``set_frozen(k)`` freezes stages[:k] (``requires_grad=False``, eval mode)
    and computes their fingerprints once; unfreezing restores gradients and
    the model's train/eval mode. Call it instead of the model:
    ``logits = cached(batch.ids, inputs, variant=batch.variant)``.

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
        zstd_level: int = 0,
        lookahead: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        self.model = model
        self.connection = connection
        self.varlen = varlen
        self.zstd_level = zstd_level
        self.enabled = connection is not None
        self.disabled_reason = "" if connection is not None else "no connection"
        self.times = StepTimes()
        device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
        self.stager = Stager(device)
        self._frozen = 0
        self._fingerprints: list[bytes] = prefix_fingerprints(list(model.stages), 0)
        self._seed_depths: list[int] = []  # frozen depths (< k) whose entries may seed depth k
        self._lookahead = Lookahead(connection, lookahead) if connection is not None and lookahead else None
        self._suffix_wrapper: Callable[[Suffix], nn.Module] | None = None
        self._suffix: nn.Module | None = None

    # ---- freezing --------------------------------------------------------

    @property
    def frozen(self) -> int:
        return self._frozen

    def fingerprint(self, depth: int | None = None) -> bytes:
        """Fingerprint of stages[:depth] (default: the frozen prefix)."""
        return self._fingerprints[self._frozen if depth is None else depth]

    def set_frozen(self, depth: int) -> None:
        """Freeze stages[:depth] and unfreeze the rest; the last stage always trains."""
        stages = list(self.model.stages)
        if not 0 <= depth < len(stages):
            raise ValueError(f"frozen depth must be in 0..{len(stages) - 1} (the head always trains), got {depth}")
        old, old_fps = self._frozen, self._fingerprints
        for i, stage in enumerate(stages):
            stage.requires_grad_(i >= depth)
            stage.train(self.model.training if i >= depth else False)
        self._fingerprints = prefix_fingerprints(stages, depth)
        # Depths still frozen with unchanged weights keep their entries as seeds.
        candidates = set(self._seed_depths) | ({old} if old else set())
        self._seed_depths = sorted(
            (d for d in candidates if 0 < d < depth and d < len(old_fps) and old_fps[d] == self._fingerprints[d]),
            reverse=True,
        )
        self._frozen = depth
        if self._lookahead is not None:
            self._lookahead.retarget(self._fingerprints[depth], depth)
        self._rewrap()

    # ---- the active suffix -----------------------------------------------

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

    # ---- epoch order -----------------------------------------------------

    def begin_epoch(self, batches: Sequence[Sequence[int]], variant: int, start: int = 0) -> None:
        """Called by CachedLoader with this rank's batches for the epoch, so lookups run ahead."""
        if self._lookahead is not None:
            self._lookahead.begin_epoch(batches, variant, start)

    def disable(self, reason: str) -> None:
        """Stop using the cache (recompute every step), e.g. for uncacheable data."""
        self.enabled = False
        self.disabled_reason = reason

    # ---- the step --------------------------------------------------------

    def __call__(self, ids: Tensor | Sequence[int], inputs: State, *, variant: int = 0) -> State:
        """Full forward pass: the frozen prefix (cached or computed) then the active suffix with grad."""
        state = self.prefix(ids, inputs, variant=variant)
        t1 = time.perf_counter()
        out = self.model.run(state, self._frozen) if self._suffix is None else self._suffix(state)
        self.times.suffix_forward += time.perf_counter() - t1
        self.times.steps += 1
        return out

    def prefix(self, ids: Tensor | Sequence[int], inputs: State, *, variant: int = 0) -> State:
        """The state after the frozen stages for this batch (no grad)."""
        k = self._frozen
        if k == 0:
            return inputs
        id_list = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        for stage in self.model.stages[:k]:
            stage.train(False)  # a user's model.train() must not put frozen stages back in train mode
        if not self.enabled:
            return self._compute(inputs, 0, k)
        self.connection.surface()
        t0 = time.perf_counter()
        values = self._lookup(self._fingerprints[k], k, id_list, variant)
        self.times.fetch_wait += time.perf_counter() - t0
        hit_rows = [i for i, v in enumerate(values) if v is not None]
        parts: list[tuple[list[int], State]] = []
        if hit_rows:
            parts.append((hit_rows, self._collate([values[i] for i in hit_rows])))
            self.times.cached_samples += len(hit_rows)
        missing = [i for i, v in enumerate(values) if v is None]
        for depth in self._seed_depths:
            if not missing:
                break
            found = self._lookup(self._fingerprints[depth], depth, [id_list[i] for i in missing], variant, ahead=False)
            rows = [i for i, v in zip(missing, found) if v is not None]
            if rows:
                seeded = self._compute(self._collate([v for v in found if v is not None]), depth, k)
                self._store(k, [id_list[i] for i in rows], variant, seeded)
                parts.append((rows, seeded))
                self.times.seeded_samples += len(rows)
                missing = [i for i in missing if i not in set(rows)]
        if missing:
            raw = inputs if len(missing) == len(id_list) else _select(inputs, missing)
            computed = self._compute(raw, 0, k)
            self._store(k, [id_list[i] for i in missing], variant, computed)
            parts.append((missing, computed))
            self.times.computed_samples += len(missing)
        return parts[0][1] if len(parts) == 1 else _merge(len(id_list), parts, self.varlen)

    # ---- helpers ---------------------------------------------------------

    def _lookup(self, fingerprint: bytes, depth: int, ids: list[int], variant: int, *, ahead: bool = True) -> list:
        assert self.connection is not None
        values = None
        if ahead and self._lookahead is not None:
            values = self._lookahead.take(fingerprint, depth, ids, variant)
        if values is None:
            values = self.connection.lookup(fingerprint, depth, ids, [variant] * len(ids))
        return values if values is not None else [None] * len(ids)

    def _collate(self, entries: list) -> State:
        host = collate_entries(entries, varlen=self.varlen, alloc=self.stager.allocator())
        return self.stager.to_device(host)

    def _compute(self, state: State, start: int, stop: int) -> State:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.run(state, start, stop)
        self.times.prefix += time.perf_counter() - t0
        return out

    def _store(self, depth: int, ids: list[int], variant: int, state: State) -> None:
        # A private copy: the suffix may modify its input in place (e.g. ReLU(inplace=True)).
        snapshot = tuple(t.detach().clone() for t in state) if isinstance(state, tuple) else state.detach().clone()
        varlen, level = self.varlen, self.zstd_level
        self.connection.store(
            self._fingerprints[depth], depth, ids, [variant] * len(ids),
            lambda: encode_samples(snapshot, zstd_level=level, varlen=varlen),
        )


def _select(state: State, rows: list[int]) -> State:
    index = torch.tensor(rows)
    if isinstance(state, tuple):
        return tuple(t.index_select(0, index.to(t.device)) for t in state)
    return state.index_select(0, index.to(state.device))


def _merge(batch: int, parts: list[tuple[list[int], State]], varlen: VarLen | None) -> State:
    """Put part states back in batch order; with VarLen, pad to the longest part and rebuild the mask."""
    tuples = [(rows, s if isinstance(s, tuple) else (s,)) for rows, s in parts]
    count = len(tuples[0][1])
    merged = []
    for j in range(count):
        pieces = [(rows, s[j]) for rows, s in tuples]
        ref = pieces[0][1]
        shape = list(ref.shape)
        shape[0] = batch
        if varlen is not None:
            shape[1] = max(p.shape[1] for _, p in pieces)
        out = torch.zeros(shape, dtype=ref.dtype, device=ref.device)
        for rows, piece in pieces:
            index = torch.tensor(rows, device=ref.device)
            if varlen is not None:
                out[index, : piece.shape[1]] = piece
            else:
                out.index_copy_(0, index, piece)
        merged.append(out)
    return merged[0] if count == 1 and not isinstance(parts[0][1], tuple) else tuple(merged)
