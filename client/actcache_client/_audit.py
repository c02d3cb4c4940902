"""Audits: recompute a small, deterministic share of served samples and compare with the entries.

A key covers the weights and a fingerprint of the data (actcache_client._identity),
but no key sees everything: an item outside the fingerprint's spread that
changed, a dataset that returns other data under the same type and length, a
peer that wrote wrong bytes under the right key. The auditor picks which hits
to recompute:

- the first ``first_samples`` hits after each (re)connection to the daemon
  and each change of the cache target (fingerprint, depth);
- then one hit in every ``every``, ``group`` consecutive hits at a time (a
  running count, so the share is exact and the choice deterministic for a
  given order).

Why groups: an audit recomputes the frozen prefix, and on a batch of one
that costs most of what a batch of eight does (ResNet-20, 10 of 11 stages,
one CPU thread: 1.9 ms for one sample, 6.4 ms for eight), and each audited
sample makes its batch a partly loaded one. Eight hits every 8,000 cost the
trainer about a third of one hit every 1,000, for the same share.

``same_entry`` compares a served entry with the entry the prefix computes now,
tensor by tensor: same dtypes and shapes, values within a tolerance for the
stored dtype (kernels differ slightly between batch sizes, so bit equality is
too strict; another sample's or another dataset's activations are far off).
On CUDA with TF32 enabled (PyTorch's default for convolutions), float32
outputs carry fp16's 10-bit mantissa and get fp16's tolerance
(``tolerances``; bench/bench_audit_tolerance.py measures the deviations).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from actcache.errors import ConfigError
from actcache_client._tensors import collate_entries

__all__ = ["AuditConfig", "Auditor", "CacheMismatchWarning", "same_entry", "tolerances"]

# Largest |served - computed| allowed, relative to the largest |computed| of that tensor.
_RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
_TF32_TOLERANCE = {**_RELATIVE_TOLERANCE, torch.float32: _RELATIVE_TOLERANCE[torch.float16]}


def tolerances(device: torch.device) -> Mapping[torch.dtype, float]:
    """Relative tolerance per stored dtype for outputs computed on ``device`` with its current precision settings."""
    return _TF32_TOLERANCE if device.type == "cuda" and _tf32_enabled() else _RELATIVE_TOLERANCE


def _tf32_enabled() -> bool:
    with warnings.catch_warnings():  # newer torch versions warn about the older flags; they still reflect the setting
        warnings.simplefilter("ignore")
        return (torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
                or torch.get_float32_matmul_precision() != "highest")


class CacheMismatchWarning(RuntimeWarning):
    """An audited entry differed from its recomputation: its fingerprint's entries were dropped."""


@dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """Which served samples ``CachedForward`` recomputes to check the cache (``audit=False``: none)."""

    #: Hits audited after each (re)connection and each change of cache target.
    first_samples: int = 8
    #: Then one hit in ``every``; 0 audits only the first samples.
    every: int = 1000
    #: Periodic audits come this many consecutive hits at a time (recomputed in one forward).
    group: int = 8

    def __post_init__(self) -> None:
        if self.first_samples < 0:
            raise ConfigError(f"AuditConfig.first_samples must be >= 0, got {self.first_samples}")
        if self.every < 0:
            raise ConfigError(f"AuditConfig.every must be >= 0 (0: only the first samples), got {self.every}")
        if self.group < 1:
            raise ConfigError(f"AuditConfig.group must be >= 1, got {self.group}")


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
    a, b = collate_entries([served]), collate_entries([computed])
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        allowed = tolerance.get(y.dtype)
        if allowed is None:
            if not torch.equal(x, y):
                return False
            continue
        x, y = x.float(), y.float()
        if not torch.isfinite(x).equal(torch.isfinite(y)):
            return False
        finite = torch.isfinite(y)
        scale = float(y[finite].abs().max()) if finite.any() else 0.0
        if finite.any() and float((x[finite] - y[finite]).abs().max()) > allowed * max(scale, 1e-6):
            return False
    return True


def warn_mismatch(namespace: str, fingerprint: bytes, depth: int, samples: int) -> None:
    warnings.warn(
        f"actcache: {samples} audited entries of namespace {namespace!r}, fingerprint {fingerprint.hex()}, "
        f"depth {depth} differ from what the frozen prefix computes for them: they were not made from this "
        "data or these weights. Dropped that fingerprint's entries and recomputing; if the data changed "
        "without changing its spread, name the version with IndexedDataset(data_id=...)",
        CacheMismatchWarning, stacklevel=4,
    )
