"""Who decides what is frozen during a benchmark run: the plug-in point for the freeze controller.

The trainer calls ``before_step`` ahead of every step (the place to apply a
decision with ``model.set_frozen(k)``) and ``after_backward`` once the
gradients exist and before the optimizer steps (where AutoFreeze reads
gradient norms). ``full`` never freezes; ``static`` freezes a fixed prefix at
a fixed point of training. ``autofreeze`` and ``egeria`` need the freeze
controller (``actcache_client.freeze`` has their policies, not yet the code
that applies them): when it lands, wrap it in a class with these two methods
and return it from :func:`make_freezer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from actcache_client import CachedForward

__all__ = ["Freezer", "FreezerUnavailable", "MODES", "NoFreeze", "StaticFreeze", "StepInfo", "make_freezer"]

MODES = ("full", "static", "autofreeze", "egeria")


class FreezerUnavailable(NotImplementedError):
    """The requested freeze mode cannot run in this build."""


@dataclass(frozen=True)
class StepInfo:
    """Where training is: ``epoch`` is fractional (1.5 = halfway through the second epoch)."""

    step: int
    epoch: float
    lr: float
    loss: float | None  # of the previous step


class Freezer(Protocol):
    name: str

    def before_step(self, info: StepInfo, model: CachedForward) -> None: ...

    def after_backward(self, info: StepInfo, model: CachedForward) -> None: ...


class NoFreeze:
    """Full training: every stage trains for the whole run."""

    name = "full"

    def before_step(self, info: StepInfo, model: CachedForward) -> None:
        pass

    def after_backward(self, info: StepInfo, model: CachedForward) -> None:
        pass


class StaticFreeze:
    """Freeze ``stages[:depth]`` once ``at_epoch`` (fractional) epochs have run; never unfreeze."""

    name = "static"

    def __init__(self, depth: int, at_epoch: float) -> None:
        if depth < 1 or at_epoch < 0:
            raise ValueError(f"static freezing needs depth >= 1 and at_epoch >= 0, got depth={depth} at_epoch={at_epoch}")
        self.depth, self.at_epoch = depth, at_epoch

    def before_step(self, info: StepInfo, model: CachedForward) -> None:
        if info.epoch >= self.at_epoch and model.frozen != self.depth:
            model.set_frozen(self.depth)

    def after_backward(self, info: StepInfo, model: CachedForward) -> None:
        pass


def make_freezer(mode: str, *, static_depth: int, static_at_epoch: float) -> Freezer:
    """The freezer of a benchmark mode (see :data:`MODES`)."""
    if mode == "full":
        return NoFreeze()
    if mode == "static":
        return StaticFreeze(static_depth, static_at_epoch)
    if mode in ("autofreeze", "egeria"):
        raise FreezerUnavailable(
            f"mode {mode!r} is not available yet: it needs the freeze controller that applies "
            f"actcache_client.freeze policies during training. Run --mode full or static for now; the plug-in "
            f"point is make_freezer() in bench/workloads/freezers.py")
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
