"""AutoFreeze's gradient-norm test (AutoFreeze, §3.1, Algorithm 1), and the norms it tests.

Each observation with a new ``step`` closes an evaluation interval T; the
controller passes each stage's norm of the gradients accumulated over it. For
every active stage l::

    eta_l = | ||Δ_{T-1,l}|| - ||Δ_{T,l}|| | / ||Δ_{T-1,l}||
    threshold = N-th percentile of eta over the active judged stages: not the head (the
                last stage, which always trains), not the embedding stages (linear
                interpolation, numpy's default rule; a zero previous norm makes eta infinite)

The frontmost active stage freezes while its eta < threshold; the first
``embedding_stages`` stages freeze with the first judged one (§4). After a
FREEZE_NEXT the controller asks again at the same ``step`` (Algorithm 1's
loop). A stage is judged only with finite norms from two consecutive intervals
in which it was active. docs/guides/freeze-policies.md says why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from actcache.errors import ConfigError
from actcache_client.freeze.policy import Decision, Signals, check_state_version, relative_change

__all__ = ["AutoFreezeConfig", "AutoFreezePolicy", "GradNormAccumulator"]

_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoFreezeConfig:
    """Knobs of the gradient-norm test; defaults are the paper's.

    Attributes:
        percentile: N: freeze while eta is below this percentile of the active stages' eta. Paper: the
            median, 50 (§4).
        intervals_per_epoch: Evaluation intervals per epoch, i.e. how often the controller calls observe.
            Paper: 5 (§4).
        embedding_stages: Stages before the first judged one, frozen with it (BERT staged by ``from_bert``:
            1, the embeddings).

    Raises:
        ConfigError: A knob is out of range.
    """

    #: N: freeze while eta is below this percentile of the active stages' eta. Paper: the median, 50 (§4).
    percentile: float = 50.0
    #: Evaluation intervals per epoch, i.e. how often the controller calls observe. Paper: 5 (§4).
    intervals_per_epoch: int = 5
    #: Stages before the first judged one, frozen with it (BERT staged by ``from_bert``: 1, the embeddings).
    embedding_stages: int = 0

    def __post_init__(self) -> None:
        if self.embedding_stages < 0:
            raise ConfigError(f"embedding_stages={self.embedding_stages} must be >= 0 (1 for BERT's embeddings)")
        if not 0 < self.percentile <= 100:
            raise ConfigError(f"percentile={self.percentile} must be in (0, 100] (the paper uses 50, the median)")
        if self.intervals_per_epoch < 1:
            raise ConfigError(f"intervals_per_epoch={self.intervals_per_epoch} must be >= 1 (the paper uses 5)")


def _percentile(values: list[float], percentile: float) -> float:
    ordered = sorted(values)
    rank = percentile / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    fraction = rank - low
    if fraction == 0 or ordered[low] == ordered[low + 1]:  # also spares inf - inf
        return ordered[low]
    return ordered[low] + (ordered[low + 1] - ordered[low]) * fraction


class AutoFreezePolicy:
    """Freeze the frontmost active stage when its gradient norm changes slower than most.

    Invariants: ``eta`` and ``threshold`` belong to the interval ending at ``step``;
    ``prev`` holds that interval's norms, None for stages frozen during it.

    Args:
        config: The test's knobs; default: the paper's (``AutoFreezeConfig()``).
    """

    needs = frozenset({"grad_norms"})

    def __init__(self, config: AutoFreezeConfig | None = None) -> None:
        self.config = config or AutoFreezeConfig()
        self._step: int | None = None
        self._prev: list[float | None] = []
        self._eta: list[float | None] = []
        self._threshold: float | None = None

    def observe(self, signals: Signals) -> Decision:
        """Freeze the frontmost active stage if its gradient norm's relative change (eta) is below the percentile.

        Args:
            signals: The evaluation's signals; ``grad_norms`` is needed at every new step.

        Returns:
            The decision and the numbers it was based on.

        Raises:
            ConfigError: ``signals.grad_norms`` is missing at a new step.
        """
        if signals.step != self._step:  # a new interval closed: eta and threshold from its norms
            if signals.grad_norms is None:
                raise ConfigError("AutoFreezePolicy needs signals.grad_norms (one accumulated gradient norm per "
                                 "stage) at every new step; compute them or choose another policy")
            norms = [g if i >= signals.frozen and math.isfinite(g) else None
                     for i, g in enumerate(signals.grad_norms)]
            prev = self._prev if len(self._prev) == len(norms) else [None] * len(norms)
            self._eta = [None if p is None or c is None else relative_change(p, c)
                         for p, c in zip(prev, norms, strict=True)]
            first = max(signals.frozen, self.config.embedding_stages)
            pool = [e for e in self._eta[first: signals.num_stages - 1] if e is not None]  # the head is no candidate
            self._threshold = _percentile(pool, self.config.percentile) if pool else None
            self._prev = norms
            self._step = signals.step
        stage = signals.frozen
        if stage >= signals.num_stages - 1:
            return Decision.none("only the head is active; it always trains")
        judged = max(stage, self.config.embedding_stages)  # embedding stages go with the first judged one
        if judged >= signals.num_stages - 1:
            return Decision.none(f"stage {stage}: no judged stage before the head "
                                 f"(embedding_stages={self.config.embedding_stages})")
        eta = self._eta[judged] if judged < len(self._eta) else None
        which = f"stage {stage}" if judged == stage else f"stage {stage} (with stage {judged})"
        if eta is None or self._threshold is None:
            return Decision.none(f"{which}: needs gradient norms from two consecutive intervals")
        numbers = {"eta": eta, "threshold": self._threshold, "percentile": self.config.percentile}
        low = eta < self._threshold
        reason = (f"{which}: eta {eta:.3g} {'<' if low else '>='} {self.config.percentile:g}th percentile "
                  f"{self._threshold:.3g}")
        return Decision.freeze(stage, reason, numbers) if low else Decision.none(reason, numbers)

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "step": self._step, "prev": list(self._prev),
                "eta": list(self._eta), "threshold": self._threshold}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a ``state_dict()`` of a policy built with the same configuration.

        Args:
            state: The saved state.

        Raises:
            ConfigError: The state was saved by an incompatible version.
        """
        check_state_version("AutoFreezePolicy", state, _STATE_VERSION)
        self._step = state["step"]
        self._prev = [None if v is None else float(v) for v in state["prev"]]
        self._eta = [None if v is None else float(v) for v in state["eta"]]
        self._threshold = None if state["threshold"] is None else float(state["threshold"])


class GradNormAccumulator:
    """Per-stage L1 norms of the gradients summed over an evaluation interval (Δ_T); frozen stages report nan.

    ``add()`` runs once per optimizer step, after backward (and DDP's all-reduce). Invariants: buffers
    exist only for active parameters; one shared by two stages is summed once and counts in both norms.

    Args:
        stages: The stages, in order.
    """

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        self._stages = [list(s.parameters()) for s in stages]
        self.set_frozen(0)

    def set_frozen(self, frozen: int) -> None:
        """Only stages[frozen:] are summed from now on; the current interval restarts.

        Args:
            frozen: The number of frozen stages.
        """
        self._frozen = frozen
        self._active = list({id(p): p for params in self._stages[frozen:] for p in params}.values())
        self._sums: dict[int, torch.Tensor] = {}
        self.steps = 0

    def add(self) -> None:
        """Add the current ``.grad`` of every active parameter (None grads are skipped)."""
        with torch.no_grad():
            for p in self._active:
                if p.grad is not None and id(p) in self._sums:
                    self._sums[id(p)].add_(p.grad)
                elif p.grad is not None:
                    self._sums[id(p)] = p.grad.detach().clone()
        self.steps += 1

    def norms(self) -> list[float] | None:
        """One L1 norm per stage (nan for frozen stages), or None if nothing was added; starts a new interval."""
        if self.steps == 0:
            return None
        device = next(iter(self._sums.values())).device if self._sums else None  # where the gradients live
        totals: list[torch.Tensor] = []
        for params in self._stages[self._frozen:]:
            parts = [self._sums[id(p)].float().abs().sum() for p in params if id(p) in self._sums]
            totals.append(torch.stack(parts).sum() if parts else torch.zeros((), device=device))
        values = torch.stack(totals).tolist() if totals else []
        self._sums, self.steps = {}, 0
        return [math.nan] * self._frozen + values
