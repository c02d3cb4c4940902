"""Applies a freeze policy to a training run: signals in, decisions out, the same on every rank.

A training step with the controller::

    out = cached(batch.ids, x, variant=batch.variant)   # probe steps: stage s's input captured
    loss = F.cross_entropy(out, y)
    opt.zero_grad(); loss.backward()
    opt.step()              # pre-hook: ctl.after_backward(): frozen grads -> None, grad sums if needed
    ctl.step(loss, epoch=batch.epoch)                 # every eval_every steps: an evaluation

At an evaluation rank 0 builds the ``Signals`` (mean loss, summed gradients'
norms, the latest plasticity reading, never waited for) and calls
``policy.observe``, again after each FREEZE_NEXT (Algorithm 1's loop); every
rank applies the broadcast depth through ``CachedForward.set_frozen``. The
optimizer is never rebuilt: frozen parameters get ``grad = None``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from actcache.errors import ConfigError, LifecycleError
from actcache_client.cost_model import Plan
from actcache_client.engine._cached_forward import CachedForward
from actcache_client.freeze import _refproc
from actcache_client.freeze.autofreeze import GradNormAccumulator
from actcache_client.freeze.defaults import default_policy, eval_every_for, run_length
from actcache_client.freeze.policy import (
    Decision,
    DecisionKind,
    FreezePolicy,
    Signals,
    check_state_version,
    depth_after,
)
from actcache_client.freeze.reference import PlasticityProbe, ReferenceConfig, ReferenceStats
from actcache_client.freeze.static import NoFreezePolicy
from actcache_client.freeze.timeline import Timeline

__all__ = ["FreezeController"]

log = logging.getLogger("actcache_client.freeze")

_STATE_VERSION = 1
#: The reference process's counters copied into every evaluation record.
_REFERENCE_COUNTERS = ("submitted", "readings", "skipped_full", "skipped_busy", "dropped", "snapshots_dropped")
#: The cost model's plan fields copied as they are into every plan record.
_PLAN_FIELDS = ("cache_depth", "cached_fraction", "expected_step_s", "baseline_step_s", "write_epoch_extra_s", "reason")


class FreezeController:
    """Drives ``policy`` on ``cached``'s stages; see the module docstring for the step protocol.

    Invariants: ``cached.frozen`` changes only at evaluations, to the depth
    rank 0 decided, on every rank at the same step; frozen parameters have
    ``grad is None`` when the optimizer steps; at most one probe per interval.
    The evaluations and DDP (re-)wraps are collectives, so every rank needs the
    same ``eval_every`` and calls ``step()`` once per optimizer step.

    Without ``policy`` or ``eval_every``, the run's length (``total_steps``, or
    ``steps_per_epoch`` and ``epochs``) picks them (``default_policy``); a run
    too short, or of unknown length, never freezes and warns once.

    Args:
        cached: The cached forward whose stages are frozen.
        optimizer: The training optimizer; never rebuilt (frozen parameters get ``grad = None``).
        policy: Decides when to freeze; default: picked from the run's length.
        eval_every: Steps between evaluations (Egeria's n, AutoFreeze's T); default: picked from the run's length.
        total_steps: The run's length in optimizer steps.
        steps_per_epoch: Optimizer steps per epoch (with ``epochs``, the run's length when ``total_steps`` is not given).
        epochs: The run's epochs.
        reference: The reference process (plasticity policies; the script needs the
            ``if __name__ == "__main__":`` guard).
        timeline: A JSON-lines file of the evaluations and decisions (rank 0 writes it).
        hook_optimizer: Call ``after_backward`` from an optimizer step pre-hook.
        process_group: The process group of the collectives and of DDP.
        ddp: Wrap the active stages in DDP (default: with more than one rank).
        ddp_kwargs: Keyword arguments for ``DistributedDataParallel``.

    Raises:
        ConfigError: ``eval_every`` is not a positive number of steps.
    """

    def __init__(self, cached: CachedForward, optimizer: torch.optim.Optimizer, policy: FreezePolicy | None = None,
                 *, eval_every: int | None = None, total_steps: int | None = None,
                 steps_per_epoch: int | None = None, epochs: int | None = None,
                 reference: ReferenceConfig | None = None, timeline: str | None = None, hook_optimizer: bool = True,
                 process_group: Any = None, ddp: bool | None = None,
                 ddp_kwargs: Mapping[str, Any] | None = None) -> None:
        if eval_every is not None and (not isinstance(eval_every, int) or eval_every < 1):
            raise ConfigError(f"eval_every={eval_every!r} must be a positive number of steps (Egeria uses "
                              "~300 for ResNet-56; AutoFreeze: an epoch's steps / 5)")
        length = run_length(total_steps, steps_per_epoch, epochs)
        num_stages = cached.model.num_stages
        if policy is None:
            policy, default_every = default_policy(length, num_stages)
            eval_every = eval_every or default_every
        elif eval_every is None:
            eval_every = eval_every_for(policy, total_steps=length, steps_per_epoch=steps_per_epoch,
                                        num_stages=num_stages)
        #: The run's length in optimizer steps, when given.
        self.total_steps = length
        self.cached = cached
        self.optimizer = optimizer
        self.policy = policy
        self.eval_every = eval_every
        self.group = process_group
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if initialized else 0
        self.world = dist.get_world_size(process_group) if initialized else 1
        self.distributed = self.world > 1
        self.timeline = Timeline(timeline if self.rank == 0 else None)
        self.step_count = 0
        self.epoch = 0
        self.evaluations = 0
        #: (step, depth before, depth after) of every applied change, on every rank.
        self.changes: list[tuple[int, int, int]] = []
        self._num_stages = num_stages
        self._counts = cached.model.param_counts()
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._grads = GradNormAccumulator(list(cached.model.stages)) if "grad_norms" in policy.needs else None
        self._probe = (PlasticityProbe(cached, policy, reference, self.timeline)
                       if "plasticity" in policy.needs and self.rank == 0 else None)
        self._backward_done = False
        self._frozen_params: list[nn.Parameter] = []
        self._ddp_kwargs = dict(ddp_kwargs or {})
        #: Seconds the last DDP (re-)wrap took; None without DDP.
        self.rewrap_seconds: float | None = None
        if self.distributed if ddp is None else ddp:
            cached.set_suffix_wrapper(self._wrap_suffix)
        self._hook = optimizer.register_step_pre_hook(lambda *_: self.after_backward()) if hook_optimizer else None
        if cached.planner is not None:
            cached.planner.listeners.append(self._record_plan)
        self._track_frozen()
        if isinstance(policy, NoFreezePolicy) and self.rank == 0:
            log.warning("actcache: not freezing: %s", policy.reason)

    @property
    def frozen(self) -> int:
        return self.cached.frozen

    @property
    def reference_stats(self) -> ReferenceStats | None:
        return self._probe.worker.stats if self._probe is not None else None

    @property
    def reference_config(self) -> ReferenceConfig | None:
        """The reference process's configuration, ``max_cpu_percent="auto"`` resolved; None without one."""
        return self._probe.worker.config if self._probe is not None else None

    def after_backward(self) -> None:
        """After backward, before the optimizer step (automatic with ``hook_optimizer``); once per step."""
        if self._backward_done:
            return
        self._backward_done = True
        for p in self._frozen_params:
            p.grad = None
        if self._grads is not None:
            self._grads.add()

    def step(self, loss: torch.Tensor | float | None = None, *, lr: float | None = None,
             epoch: int | None = None) -> None:
        """Count one optimizer step; evaluate every ``eval_every`` steps.

        Args:
            loss: This step's loss; the evaluation's signal is the interval's mean.
            lr: The learning rate in the signals; default: param group 0's.
            epoch: The current epoch.
        """
        self.step_count += 1
        self._backward_done = False
        if epoch is not None:
            self.epoch = epoch
        if loss is not None:
            value = loss.detach().float() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._loss_count += 1
        if self._probe is not None:
            self._probe.step(self.step_count)
        if self.step_count % self.eval_every == 0:
            self._evaluate(lr if lr is not None else float(self.optimizer.param_groups[0]["lr"]))
        if self._probe is not None:
            self._probe.arm()

    def _evaluate(self, lr: float) -> None:
        self.evaluations += 1
        loss = float(self._loss_sum / self._loss_count) if self._loss_count and self._loss_sum is not None else None
        self._loss_sum, self._loss_count = None, 0
        if self.distributed and "loss" in self.policy.needs:  # the mean over the ranks that have one
            t = _collective_tensor([loss or 0.0, float(loss is not None)], torch.float64, self.group)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            total, count = t.tolist()
            loss = total / count if count else None
        grad_norms = self._grads.norms() if self._grads is not None else None
        if self._grads is not None and grad_norms is None:
            raise LifecycleError("the policy needs gradient norms but no gradients were summed in this interval: "
                               "call controller.after_backward() after backward (or keep hook_optimizer=True)")
        reading = self._probe.reading(self.step_count) if self._probe is not None else None
        depth, records = self._decide(lr, loss, grad_norms, reading) if self.rank == 0 else (None, [])
        if self.distributed:  # rank 0's depth on every rank
            t = _collective_tensor([depth if depth is not None else -1], torch.int64, self.group)
            dist.broadcast(t, src=0 if self.group is None else dist.get_global_rank(self.group, 0), group=self.group)
            depth = int(t.item())
        if depth is not None and depth != self.frozen:
            self._apply(depth)
            if records:
                records[-1]["rewrap_s"] = self.rewrap_seconds
        for record in records:
            self.timeline.write(record)
        if self._probe is not None:
            self._probe.interval_done()

    def _decide(self, lr: float, loss: float | None, grad_norms: list[float] | None,
                reading: _refproc.Reading | None) -> tuple[int, list[dict[str, Any]]]:
        needs = self.policy.needs
        frozen = self.frozen
        records = []
        for _ in range(self._num_stages):
            signals = Signals(step=self.step_count, epoch=self.epoch, frozen=frozen, num_stages=self._num_stages,
                              lr=lr, loss=loss if "loss" in needs else None,
                              plasticity=reading.plasticity if reading is not None and "plasticity" in needs else None,
                              grad_norms=grad_norms if "grad_norms" in needs else None)
            decision = self.policy.observe(signals)
            after = depth_after(decision, frozen, self._num_stages, f"policy {type(self.policy).__name__}")
            records.append(self._record(signals, decision, after, reading))
            if decision.kind is not DecisionKind.FREEZE_NEXT:
                return after, records
            frozen, reading = after, None  # the reading was of the stage just frozen
        return frozen, records

    def _record(self, signals: Signals, decision: Decision, after: int,
                reading: _refproc.Reading | None) -> dict[str, Any]:
        numbers = decision.numbers
        signal: str | None
        if "plasticity" in self.policy.needs:
            signal, value = "plasticity", signals.plasticity
        elif "grad_norms" in self.policy.needs:
            signal, value = "eta", numbers.get("eta")
        else:
            signal, value = ("loss", signals.loss) if "loss" in self.policy.needs else (None, None)
        stats = self.reference_stats
        return {
            "event": "evaluation", "step": signals.step, "epoch": signals.epoch, "stage": signals.frozen,
            "stage_name": self.cached.model.stage_names[signals.frozen], "signal": signal, "value": value,
            "loss": signals.loss, "plasticity": signals.plasticity,
            "plasticity_step": reading.step if reading is not None else None,
            "reference_age": reading.age if reading is not None else None,
            "grad_norm": signals.grad_norms[signals.frozen] if signals.grad_norms else None,
            "smoothed": numbers.get("smoothed"), "threshold": numbers.get("threshold"),
            "decision": decision.kind.value, "reason": decision.reason, "lr": signals.lr, "frozen": after,
            "active_param_share": self.active_param_share(after), "rewrap_s": None, "numbers": dict(numbers),
            "reference": None if stats is None else {k: getattr(stats, k) for k in _REFERENCE_COUNTERS},
        }

    def _record_plan(self, frozen: int, plan: Plan) -> None:
        self.timeline.write({"event": "plan", "step": self.step_count, "epoch": self.epoch, "frozen": frozen,
                             "mode": plan.mode.value, "recompute_stages": list(plan.recompute_stages),
                             "numbers": dict(plan.numbers), **{k: getattr(plan, k) for k in _PLAN_FIELDS}})

    def active_param_share(self, frozen: int | None = None) -> float:
        """Share of parameter elements in the active stages.

        Args:
            frozen: The frozen depth to compute it for; default: the current one.
        """
        frozen = self.frozen if frozen is None else frozen
        total = sum(self._counts)
        return sum(self._counts[frozen:]) / total if total else 1.0

    def _apply(self, depth: int) -> None:
        before = self.frozen
        self.cached.set_frozen(depth)  # requires_grad, eval mode, fingerprints, DDP re-wrap
        self._track_frozen()
        self.changes.append((self.step_count, before, depth))
        if self.rank == 0:
            log.info("actcache: step %d: frozen stages %d -> %d (%.1f%% of parameters active)",
                     self.step_count, before, depth, 100 * self.active_param_share(depth))
        if self._probe is not None:
            self._probe.depth_changed()

    def _wrap_suffix(self, suffix: nn.Module) -> nn.Module:
        """DDP around the active stages only (frozen ones take no gradient buckets), timed."""
        start = time.perf_counter()
        wrapped = nn.parallel.DistributedDataParallel(suffix, process_group=self.group, **self._ddp_kwargs)
        self.rewrap_seconds = time.perf_counter() - start
        log.info("actcache: DDP wrapped %d active stages in %.3f s", len(getattr(suffix, "stages", ())),
                 self.rewrap_seconds)
        return wrapped

    def _track_frozen(self) -> None:
        stages = list(self.cached.model.stages)
        active = {id(p) for s in stages[self.frozen:] for p in s.parameters()}
        self._frozen_params = [p for s in stages[: self.frozen] for p in s.parameters() if id(p) not in active]
        for p in self._frozen_params:
            p.grad = None
        if self._grads is not None:
            self._grads.set_frozen(self.frozen)

    def state_dict(self) -> dict[str, Any]:
        """Counters, the frozen depth and its fingerprint, the policy's state (save rank 0's)."""
        return {"version": _STATE_VERSION, "step": self.step_count, "epoch": self.epoch,
                "evaluations": self.evaluations, "frozen": self.frozen,
                "fingerprint": self.cached.weights_fingerprint().hex(), "policy": self.policy.state_dict(),
                "changes": [list(c) for c in self.changes]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: load the model's weights first; the frozen prefix (and so its cache entries) is restored.

        An interval in progress at the checkpoint restarts (its loss and gradient sums are not saved).

        Args:
            state: A ``state_dict()`` of this class.

        Raises:
            ConfigError: The model's frozen stages' weights differ from the checkpoint's.
        """
        check_state_version("controller", state, _STATE_VERSION)
        depth = int(state["frozen"])
        if depth != self.frozen:
            self._apply(depth)
        fingerprint = self.cached.weights_fingerprint().hex()
        if fingerprint != state["fingerprint"]:
            raise ConfigError(f"the model's first {depth} stages have fingerprint {fingerprint} but the checkpoint "
                              f"recorded {state['fingerprint']}: load the model's state_dict (the same weights) "
                              "before the controller's")
        self.policy.load_state_dict(state["policy"])
        self.step_count, self.epoch = int(state["step"]), int(state["epoch"])
        self.evaluations = int(state["evaluations"])
        self.changes = [tuple(c) for c in state["changes"]]

    def close(self) -> None:
        """Stop the reference process, remove the hooks, close the timeline. The frozen depth stays."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._probe is not None:
            self._probe.close()
        if self.cached.planner is not None and self._record_plan in self.cached.planner.listeners:
            self.cached.planner.listeners.remove(self._record_plan)
        self.timeline.close()

    def __enter__(self) -> FreezeController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _collective_tensor(values: list[float], dtype: torch.dtype, group: Any) -> torch.Tensor:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    return torch.tensor(values, dtype=dtype, device=device)
