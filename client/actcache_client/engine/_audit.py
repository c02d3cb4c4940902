"""Audits: recompute a small, deterministic share of served samples and compare with the entries.

No key sees everything (an item outside the data fingerprint's spread that changed, a peer that wrote
wrong bytes under the right key). Periodic audits come ``group`` hits at a time: recomputing one sample
costs most of what eight cost. Entries match within a tolerance for the stored dtype (kernels differ
slightly between batch sizes; bench/bench_audit_tolerance.py measures the deviations).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from actcache.errors import CacheMismatchError, ConfigError
from actcache_client.engine._counters import StepTimes
from actcache_client.engine._frozen import WrittenFingerprints
from actcache_client.engine._rows import RawInputs
from actcache_client.layouts._stages import StagedModel
from actcache_client.transport._connection import connected
from actcache_client.transport._state import tensors_of
from actcache_client.transport._tensors import (
    StorePrecision,
    VarLen,
    collate_entries,
    encode_samples,
)

if TYPE_CHECKING:
    from actcache_client.transport._connection import Connection

__all__ = ["AuditConfig", "Auditor", "CacheMismatchWarning", "HitAudit", "same_entry", "tolerances"]

# Largest |served - computed| allowed, relative to the largest |computed| of that tensor.
_RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
_TF32_TOLERANCE = {**_RELATIVE_TOLERANCE, torch.float32: _RELATIVE_TOLERANCE[torch.float16]}


def tolerances(device: torch.device) -> Mapping[torch.dtype, float]:
    """Relative tolerance per stored dtype for outputs computed on ``device`` with its current precision settings."""
    if device.type != "cuda":
        return _RELATIVE_TOLERANCE
    with warnings.catch_warnings():  # newer torch versions warn about the older flags; they still reflect the setting
        warnings.simplefilter("ignore")
        tf32 = (torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
                or torch.get_float32_matmul_precision() != "highest")
    return _TF32_TOLERANCE if tf32 else _RELATIVE_TOLERANCE


class CacheMismatchWarning(RuntimeWarning):
    """An audited entry differed from its recomputation: its fingerprint's entries were dropped."""


@dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """Which served samples ``CachedForward`` recomputes to check the cache (``audit=False``: none).

    Attributes:
        first_samples: Hits audited after each (re)connection and each change of cache target.
        every: Then one hit in ``every``; 0 audits only the first samples.
        group: Periodic audits come this many consecutive hits at a time (recomputed in one forward).

    Raises:
        ConfigError: A field is out of range.
    """

    #: Hits audited after each (re)connection and each change of cache target.
    first_samples: int = 8
    #: Then one hit in ``every``; 0 audits only the first samples.
    every: int = 1000
    #: Periodic audits come this many consecutive hits at a time (recomputed in one forward).
    group: int = 8

    def __post_init__(self) -> None:
        for name, low, hint in (("first_samples", 0, ""), ("every", 0, " (0: only the first samples)"),
                                ("group", 1, "")):
            if getattr(self, name) < low:
                raise ConfigError(f"AuditConfig.{name} must be >= {low}{hint}, got {getattr(self, name)}")


class Auditor:
    """Chooses the hits to audit; ``restart()`` after a reconnection or retarget."""

    def __init__(self, config: AuditConfig) -> None:
        self.config = config
        self._first_left = config.first_samples
        self._count = 0  # hits into the current period of every * group hits

    def restart(self) -> None:
        self._first_left = self.config.first_samples

    def choose(self, hits: int) -> list[int]:
        """Positions (in ``range(hits)``) of the hits of this batch to audit."""
        first = min(hits, self._first_left)
        self._first_left -= first
        every, group = self.config.every, self.config.group
        if not every:
            return list(range(first))
        period, start = every * group, self._count
        self._count = (start + hits) % period
        # a period's audited hits are its last ``group``
        return [p for p in range(hits) if p < first or (start + p) % period >= period - group]


def same_entry(served: bytes | memoryview, computed: bytes | memoryview,
               tolerance: Mapping[torch.dtype, float] = _RELATIVE_TOLERANCE) -> bool:
    """Whether two entries hold the same tensors, within the stored dtype's ``tolerance`` (see ``tolerances``)."""
    a, b = tensors_of(collate_entries([served])), tensors_of(collate_entries([computed]))
    return len(a) == len(b) and all(_close(x, y, tolerance.get(y.dtype)) for x, y in zip(a, b))


def _close(x: torch.Tensor, y: torch.Tensor, allowed: float | None) -> bool:
    """Same dtype, shape and non-finite places; finite values within ``allowed`` of y's largest (None: equal)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if allowed is None:
        return torch.equal(x, y)
    x, y = x.float(), y.float()
    finite = torch.isfinite(y)
    if not torch.isfinite(x).equal(finite):
        return False
    if not finite.any():
        return True
    scale = float(y[finite].abs().max())
    return float((x[finite] - y[finite]).abs().max()) <= allowed * max(scale, 1e-6)


class HitAudit:
    """Recomputes the served hits an Auditor picks and compares them with the entries (``check``); the
    auditor restarts after each (re)connection (``sync``) and each new cache target (``retarget``).

    It recomputes with ``model`` on ``device``, compares in the stored ``precision`` and ``varlen`` layout,
    and on a mismatch drops the fingerprint from ``connection`` and forgets it in ``written``."""

    def __init__(self, audit: AuditConfig | bool, *, model: StagedModel, connection: Connection | None,
                 written: WrittenFingerprints, precision: StorePrecision, varlen: VarLen | None,
                 device: torch.device) -> None:
        self._model, self._connection, self._written = model, connection, written
        self._precision, self._varlen, self._device = precision, varlen, device
        self.configure(audit)
        self._opens = 0  # connection.opens when the auditor last restarted
        self._target: tuple[bytes, int] | None = None

    def configure(self, audit: AuditConfig | bool) -> None:
        """Audit per ``audit`` (True: the default AuditConfig; False: no audits)."""
        config = AuditConfig() if audit is True else audit
        self.auditor: Auditor | None = Auditor(config) if config else None

    def retarget(self, key: tuple[bytes, int] | None) -> None:
        """The cache target is now (fingerprint, depth) ``key`` (None: nothing cached)."""
        if key != self._target and self.auditor is not None:
            self.auditor.restart()
        self._target = key

    def sync(self) -> None:
        """Restart the auditor after a (re)connection to the daemon, before it next chooses."""
        if self.auditor is not None and connected(self._connection).opens != self._opens:
            self._opens = connected(self._connection).opens
            self.auditor.restart()

    def choose(self, hits: int) -> list[int]:
        return self.auditor.choose(hits) if self.auditor is not None else []

    def check(self, fingerprint: bytes, depth: int, rows: list[int], raw: RawInputs, values: list,
              found: list[int], times: StepTimes) -> bool:
        """Recompute the hits the auditor picks (``values[i]`` served for batch row ``rows[i]``, ``found``
        those served; with skipped loads, the hits loaded anyway); False, after dropping the fingerprint,
        if one differs."""
        if self.auditor is None:
            return True
        self.sync()
        if raw.partial:
            chosen = [i for i in found if raw.has(rows[i])]
        else:
            chosen = [found[p] for p in self.auditor.choose(len(found))]
        if not chosen:
            return True
        t0, connection = time.perf_counter(), connected(self._connection)
        with torch.no_grad():
            computed = self._model.run(raw.rows([rows[i] for i in chosen]), 0, depth)
        entries = encode_samples(self._precision.to_stored(computed), varlen=self._varlen)
        tolerance = tolerances(self._device)
        bad = sum(not same_entry(values[i], entry, tolerance) for i, entry in zip(chosen, entries))
        times.audit += time.perf_counter() - t0
        times.audited_samples += len(chosen)
        if not bad:
            return True
        connection.drop(fingerprint)
        self._written.forget(fingerprint)
        self.auditor.restart()
        strict = connection.config.strict
        message = (f"{bad} of {len(chosen)} audited entries of namespace {connection.config.namespace!r}, "
                   f"fingerprint {fingerprint.hex()}, depth {depth} differ from what the frozen prefix computes for "
                   "them: they were not made from this data or these weights. Dropped that fingerprint's entries"
                   f"{'' if strict else ' and recomputing'}. The cache keys see the items as the dataset returns them, "
                   "not what the DataLoader's collate_fn makes of them: tokenize, pad and transform in the dataset "
                   "(its __getitem__, or datasets' .map), not in collate_fn, so that a change (a new max_length) "
                   "gives new keys; a dataset changed only in items its fingerprint does not sample needs a new "
                   "IndexedDataset(data_id=...)")
        if strict:
            raise CacheMismatchError(message)
        warnings.warn(f"actcache: {message}", CacheMismatchWarning, stacklevel=3)
        return False
