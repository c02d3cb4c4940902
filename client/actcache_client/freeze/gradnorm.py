"""Per-stage L1 norms of the gradients summed over an evaluation interval (AutoFreeze §3.1, Δ_T).

``add()`` runs once per optimizer step, after backward (and DDP's all-reduce);
``norms()`` closes the interval. docs/guides/freeze-policies.md says why L1.
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
        self._active = list({id(p): p for params in self._stages[frozen:] for p in params}.values())
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
