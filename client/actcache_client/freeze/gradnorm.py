"""Per-stage norms of the gradients summed over an evaluation interval (AutoFreeze §3.1, Δ_T).

The norm is L1: the paper writes ``||Δ||`` without saying which, and its
authors' implementation (uwsampl/AutoFreeze, ``freeze_intermediate_e2e_lr.py``)
sums ``torch.norm(Δ, p=1)`` over a layer's parameters. L1 weighs every
parameter's change alike; L2 lets a layer's few largest gradient entries
(a LayerNorm's, an embedding row's) decide its eta.

``add()`` runs once per optimizer step, after backward (and after DDP's
all-reduce, so every rank sums the same gradients); ``norms()`` closes the
interval. Cost: one buffer per active parameter and one in-place add per
parameter per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["GradNormAccumulator"]


class GradNormAccumulator:
    """Sums the gradients of the active stages' parameters; frozen stages report nan.

    Invariants: buffers exist only for parameters of active stages; a
    parameter shared by two stages is summed once and counts in both norms.
    """

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        self._stages = [list(s.parameters()) for s in stages]
        self._frozen = 0
        self._sums: dict[int, torch.Tensor] = {}
        self._active: list[nn.Parameter] = []
        self.steps = 0
        self.set_frozen(0)

    def set_frozen(self, frozen: int) -> None:
        """Only stages[frozen:] are summed from now on; the current interval restarts."""
        self._frozen = frozen
        seen: dict[int, nn.Parameter] = {}
        for params in self._stages[frozen:]:
            for p in params:
                seen.setdefault(id(p), p)
        self._active = list(seen.values())
        self._sums = {}
        self.steps = 0

    def add(self) -> None:
        """Add the current ``.grad`` of every active parameter (None grads are skipped)."""
        with torch.no_grad():
            for p in self._active:
                if p.grad is None:
                    continue
                buf = self._sums.get(id(p))
                if buf is None:
                    self._sums[id(p)] = p.grad.detach().clone()
                else:
                    buf.add_(p.grad)
        self.steps += 1

    def norms(self) -> list[float] | None:
        """One L1 norm per stage (nan for frozen stages), or None if nothing was added; starts a new interval."""
        if self.steps == 0:
            return None
        totals: list[torch.Tensor] = []
        for params in self._stages[self._frozen:]:
            parts = [self._sums[id(p)].float().abs().sum() for p in params if id(p) in self._sums]
            totals.append(torch.stack(parts).sum() if parts else torch.zeros(()))
        values = torch.stack(totals).tolist() if totals else []
        self._sums = {}
        self.steps = 0
        return [math.nan] * self._frozen + values
