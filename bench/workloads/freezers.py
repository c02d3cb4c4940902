"""Who decides what is frozen during a benchmark run: a fixed schedule or the freeze controller.

A freezer's life in one run (``workloads.trainer.TrainingRun``)::

    start(model, optimizer, steps_per_epoch=, total_steps=)   once, before the first step
    every step:  before_step(info, model)      apply a decision (model.set_frozen(k))
                 forward, backward
                 after_backward(info, model)   gradients exist, the optimizer has not stepped
                 optimizer step, scheduler step
    close() -> dict                            once, when the run ends or fails: stop helpers,
                                               return what the results record about the freezer

``full`` never freezes; ``static`` freezes a fixed prefix at a fixed point of
training; ``auto`` is :class:`~actcache_client.freeze.FreezeController` as a
user gets it with no policy, only the run's length; ``autofreeze`` and
``egeria`` wrap it with AutoFreeze's and Egeria's policies at the papers'
defaults. The controller's step protocol
maps onto the hooks: ``after_backward`` is the controller's
``after_backward()`` (frozen gradients dropped, AutoFreeze's gradient sums),
and the controller's ``step(loss, lr=, epoch=)`` for step k runs in
``before_step`` of step k+1, with the loss of step k and the learning rate
the scheduler set for step k+1. That is where ``controller.step`` sits in a
plain loop too (after the optimizer and scheduler, before the next forward),
so an evaluation's decision applies from the next forward on and Egeria's
probe, armed by ``step``, captures that forward.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from actcache.errors import ConfigError
from actcache_client import CachedForward
from actcache_client.freeze import (
    AutoFreezeConfig,
    AutoFreezePolicy,
    EgeriaConfig,
    EgeriaPolicy,
    FreezeController,
    FreezePolicy,
    ReferenceConfig,
    default_policy,
)
from actcache_client.freeze.defaults import autofreeze_eval_every, egeria_eval_every

__all__ = [
    "AutoFreeze",
    "AutoPolicy",
    "ControllerFreeze",
    "EgeriaFreeze",
    "Freezer",
    "MODES",
    "NoFreeze",
    "StaticFreeze",
    "StepInfo",
    "autofreeze_eval_every",
    "egeria_eval_every",
    "make_freezer",
]

MODES = ("full", "static", "auto", "autofreeze", "egeria")


@dataclass(frozen=True)
class StepInfo:
    """Where training is: ``epoch`` is fractional (1.5 = halfway through the second epoch).

    ``step`` counts the steps done so far; ``lr`` is the one the next step uses.
    """

    step: int
    epoch: float
    lr: float
    loss: float | None  # of the previous step


class Freezer(Protocol):
    name: str

    def start(self, model: CachedForward, optimizer: torch.optim.Optimizer, *, steps_per_epoch: int,
              total_steps: int) -> None: ...

    def before_step(self, info: StepInfo, model: CachedForward) -> None: ...

    def after_backward(self, info: StepInfo, model: CachedForward) -> None: ...

    def close(self) -> dict[str, Any]: ...


class _FixedSchedule:
    """A freezer that needs nothing from the run: every hook does nothing unless overridden."""

    name: str

    def start(self, model: CachedForward, optimizer: torch.optim.Optimizer, *, steps_per_epoch: int,
              total_steps: int) -> None:
        """Nothing to set up: the schedule is fixed in advance."""

    def before_step(self, info: StepInfo, model: CachedForward) -> None:
        """No decision to apply."""

    def after_backward(self, info: StepInfo, model: CachedForward) -> None:
        """No gradient signal is read."""

    def close(self) -> dict[str, Any]:
        return {"mode": self.name}


class NoFreeze(_FixedSchedule):
    """Full training: every stage trains for the whole run."""

    name = "full"


class StaticFreeze(_FixedSchedule):
    """Freeze ``stages[:depth]`` once ``at_epoch`` (fractional) epochs have run; never unfreeze."""

    name = "static"

    def __init__(self, depth: int, at_epoch: float) -> None:
        if depth < 1 or at_epoch < 0:
            raise ValueError(f"static freezing needs depth >= 1 and at_epoch >= 0, got depth={depth} at_epoch={at_epoch}")
        self.depth, self.at_epoch = depth, at_epoch

    def before_step(self, info: StepInfo, model: CachedForward) -> None:
        if info.epoch >= self.at_epoch and model.frozen != self.depth:
            model.set_frozen(self.depth)

    def close(self) -> dict[str, Any]:
        return {"mode": self.name, "depth": self.depth, "at_epoch": self.at_epoch}


class ControllerFreeze(abc.ABC):
    """A :class:`FreezeController` driving a policy through the freezer hooks (see the module docstring).

    Subclasses give the policy and the default interval; ``eval_every``
    overrides it. One instance drives one run: the controller, and with it
    the policy's state, is built in :meth:`start`. The optimizer is never
    rebuilt (the controller drops frozen gradients before each step), so
    the trainer's optimizer and scheduler keep running unchanged.
    """

    name = "controller"

    def __init__(self, *, eval_every: int | None = None) -> None:
        if eval_every is not None and (not isinstance(eval_every, int) or eval_every < 1):
            raise ConfigError(f"eval_every={eval_every!r} must be a positive number of steps, or None for the "
                              f"{self.name} default")
        self.eval_every = eval_every
        self.controller: FreezeController | None = None
        self.steps_per_epoch = 1
        self._record: dict[str, Any] | None = None

    @abc.abstractmethod
    def make_policy(self) -> FreezePolicy:
        """A fresh policy for one run."""

    @abc.abstractmethod
    def default_eval_every(self, *, steps_per_epoch: int, total_steps: int, num_stages: int) -> int:
        """Steps between evaluations when ``eval_every`` was not given."""

    def reference(self) -> ReferenceConfig | None:
        """The reference process's configuration (plasticity policies only)."""
        return None

    def settings(self) -> dict[str, Any]:
        """The policy's knobs, for the results."""
        return {}

    def start(self, model: CachedForward, optimizer: torch.optim.Optimizer, *, steps_per_epoch: int,
              total_steps: int) -> None:
        if self.controller is not None:
            raise RuntimeError(f"this {self.name} freezer already drives a run; make one per run (make_freezer)")
        self.steps_per_epoch = steps_per_epoch
        if self.eval_every is None:
            self.eval_every = self.default_eval_every(steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                                                      num_stages=model.model.num_stages)
        # hook_optimizer=False: the trainer calls after_backward itself, once per step.
        self.controller = FreezeController(model, optimizer, self.make_policy(), eval_every=self.eval_every,
                                           reference=self.reference(), hook_optimizer=False)

    def _controller(self) -> FreezeController:
        if self.controller is None:
            raise RuntimeError(f"{self.name} freezer: start() must run before the first step")
        return self.controller

    def before_step(self, info: StepInfo, model: CachedForward) -> None:
        ctl = self._controller()
        if info.step > ctl.step_count:  # step info.step - 1 is done: count it (an evaluation every eval_every)
            ctl.step(info.loss, lr=info.lr, epoch=(info.step - 1) // self.steps_per_epoch)

    def after_backward(self, info: StepInfo, model: CachedForward) -> None:
        self._controller().after_backward()

    def close(self) -> dict[str, Any]:
        """Stop the controller (and Egeria's reference process); return its settings and what it did.

        ``decisions``: every freeze and unfreeze (step, epoch, stage, depth
        after, lr, reason); ``trace``: every observation (step, stage judged,
        signal and value, slope and threshold, depth after, reason);
        ``reference_stats``: Egeria's probes and readings.
        """
        if self._record is not None:
            return self._record
        ctl = self.controller
        record: dict[str, Any] = {"mode": self.name, "eval_every": self.eval_every, "settings": self.settings()}
        if ctl is None:
            return record
        ctl.close()
        observed = [r for r in ctl.timeline.records if r.get("event") == "evaluation"]
        record.update(policy=type(ctl.policy).__name__, evaluations=ctl.evaluations, final_frozen=ctl.frozen,
                      decisions=[_decision(r, self.steps_per_epoch) for r in observed if r["decision"] != "none"],
                      trace=[{k: r[k] for k in _TRACED} for r in observed])
        stats = ctl.reference_stats
        if stats is not None:
            record["reference_stats"] = dataclasses.asdict(stats)
        self._record = record
        return record


#: What the results keep of every policy observation (the controller's timeline has more).
_TRACED = ("step", "stage", "signal", "value", "loss", "smoothed", "threshold", "frozen", "reason")


def _decision(record: dict[str, Any], steps_per_epoch: int) -> dict[str, Any]:
    """One freeze or unfreeze from the controller's timeline: when, which stage, the depth after it, why."""
    return {"step": record["step"], "epoch": record["step"] / steps_per_epoch, "decision": record["decision"],
            "stage": record["stage"], "stage_name": record["stage_name"], "frozen": record["frozen"],
            "active_param_share": record["active_param_share"], "lr": record["lr"], "reason": record["reason"]}


class AutoFreeze(ControllerFreeze):
    """AutoFreeze (gradient-norm change) at the paper's defaults: median percentile, 5 intervals per epoch.

    The interval T is an epoch's steps / 5 (:func:`autofreeze_eval_every`).
    On a model staged by ``from_bert`` the embeddings are not judged on
    their own: they freeze with the first encoder block (the paper's §4;
    ``AutoFreezeConfig.embedding_stages=1``). The head is never in the
    percentile pool.
    The paper fine-tunes BERT, as on ``sst2`` and ``cola`` here; on
    ``cifar`` (ResNet-20 from scratch) the same rule runs unchanged, so the
    results show what it costs outside its home ground. AutoFreeze never
    unfreezes, so its frozen prefix only grows and every cached entry stays
    valid until the next stage freezes.
    """

    name = "autofreeze"

    def __init__(self, config: AutoFreezeConfig | None = None, *, eval_every: int | None = None) -> None:
        super().__init__(eval_every=eval_every)
        self.embeddings_with_first_block = config is None  # an explicit config is used as given
        self.config = config or AutoFreezeConfig()

    def make_policy(self) -> FreezePolicy:
        return AutoFreezePolicy(self.config)

    def start(self, model: CachedForward, optimizer: torch.optim.Optimizer, *, steps_per_epoch: int,
              total_steps: int) -> None:
        """As the controller freezers, with BERT's embeddings frozen together with the first block (§4)."""
        if self.embeddings_with_first_block and model.model.stage_names[0] == "embeddings":  # from_bert
            self.config = dataclasses.replace(self.config, embedding_stages=1)
        super().start(model, optimizer, steps_per_epoch=steps_per_epoch, total_steps=total_steps)

    def default_eval_every(self, *, steps_per_epoch: int, total_steps: int, num_stages: int) -> int:
        return autofreeze_eval_every(steps_per_epoch, self.config.intervals_per_epoch)

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config)


class EgeriaFreeze(ControllerFreeze):
    """Egeria (plasticity against a reference model) at the paper's defaults, its reference on the CPU.

    Policy: W=10, tolerance 20% of a stage's largest smoothed reading,
    bootstrapping until the loss (averaged over 32-step spans) changes < 10%
    per interval, unfreeze all on a discrete 10x learning-rate drop since
    stage 0 froze. The interval n comes from the run's length and stage
    count (:func:`egeria_eval_every`). Reference: the controller's defaults
    (fp32, one thread, at most one probe in flight, readings
    W/2 evaluations apart, ``max_cpu_percent="auto"``: never skip a probe
    for CPU load, since these runs train on the CPU and keep it busy).

    What the learning-rate rule does per workload: ``cifar`` and ``digits``
    drop the LR 10x at 50% and 75% of the steps, so stages frozen before a
    drop are unfrozen there and refreeze with W halved (Egeria's design for
    step schedules). ``sst2``/``cola`` decay linearly after a 6% warm-up:
    the LR changes at every step, never drops discretely, and what is frozen
    stays frozen to the end.

    Readings arrive asynchronously (training never waits), so two runs of
    the same workload can freeze at different steps; the results record
    each run's decisions.
    """

    name = "egeria"

    def __init__(self, config: EgeriaConfig | None = None, *, eval_every: int | None = None,
                 reference: ReferenceConfig | None = None) -> None:
        super().__init__(eval_every=eval_every)
        self.config = config or EgeriaConfig()
        self.reference_config = reference or ReferenceConfig()

    def make_policy(self) -> FreezePolicy:
        return EgeriaPolicy(self.config)

    def default_eval_every(self, *, steps_per_epoch: int, total_steps: int, num_stages: int) -> int:
        return egeria_eval_every(total_steps, num_stages, self.config.window)

    def reference(self) -> ReferenceConfig | None:
        return self.reference_config

    def settings(self) -> dict[str, Any]:
        """The policy's knobs and the reference's, ``max_cpu_percent`` as resolved for the run's device."""
        resolved = self.controller.reference_config if self.controller is not None else None
        return {**dataclasses.asdict(self.config), "reference": dataclasses.asdict(resolved or self.reference_config)}


class AutoPolicy(ControllerFreeze):
    """The controller's default for the run's length (``FreezeController(model, opt, total_steps=N)``).

    ``default_policy`` picks the policy and interval when the run starts;
    ``eval_every`` overrides the interval.
    """

    name = "auto"

    def __init__(self, *, eval_every: int | None = None) -> None:
        super().__init__(eval_every=eval_every)
        self._policy: FreezePolicy | None = None

    def start(self, model: CachedForward, optimizer: torch.optim.Optimizer, *, steps_per_epoch: int,
              total_steps: int) -> None:
        self._policy, every = default_policy(total_steps, model.model.num_stages)
        self._every = every
        super().start(model, optimizer, steps_per_epoch=steps_per_epoch, total_steps=total_steps)

    def make_policy(self) -> FreezePolicy:
        if self._policy is None:
            raise RuntimeError("auto freezer: start() picks the policy")
        return self._policy

    def default_eval_every(self, *, steps_per_epoch: int, total_steps: int, num_stages: int) -> int:
        return self._every

    def settings(self) -> dict[str, Any]:
        policy = self._policy
        out: dict[str, Any] = {"policy": type(policy).__name__ if policy is not None else None}
        if isinstance(policy, EgeriaPolicy):
            out.update(dataclasses.asdict(policy.config))
        elif policy is not None and hasattr(policy, "reason"):
            out["reason"] = policy.reason
        return out


def make_freezer(mode: str, *, static_depth: int, static_at_epoch: float, eval_every: int | None = None) -> Freezer:
    """A fresh freezer of a benchmark mode (see :data:`MODES`); ``eval_every`` applies to the controller modes."""
    if mode == "full":
        return NoFreeze()
    if mode == "static":
        return StaticFreeze(static_depth, static_at_epoch)
    if mode == "auto":
        return AutoPolicy(eval_every=eval_every)
    if mode == "autofreeze":
        return AutoFreeze(eval_every=eval_every)
    if mode == "egeria":
        return EgeriaFreeze(eval_every=eval_every)
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
