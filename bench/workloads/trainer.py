"""One training run of a workload under a freezer, with or without the cache, measured.

``train(workload, freezer, connection)`` runs the workload's epochs through
``CachedForward`` + ``CachedLoader`` (with ``connection=None`` the frozen
prefix is recomputed every step, so a run with and without the cache is the
same computation), evaluates the dev metric ``evals_per_epoch`` times per
epoch, and returns a :class:`RunResult`: metric curve on the training clock
(wall time minus evaluation), time split, cache counters, the timeline of
frozen depth and active parameters, and what the freezer recorded (for the
controller modes, every freeze and unfreeze decision with its step and reason).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac

from .freezers import Freezer, StepInfo

__all__ = ["EvalPoint", "RunResult", "TrainingRun", "Workload", "evaluate", "interleave", "matthews", "train"]


@dataclass(kw_only=True)
class Workload:
    """A model, its data and its recipe. ``build`` returns a fresh model, the same one for every call."""

    name: str
    metric: str  # "accuracy" or "mcc", reported in points (x100)
    build: Callable[[], nn.Module]
    stage: Callable[[nn.Module], ac.StagedModel]
    train_set: Dataset
    eval_set: Dataset
    batch_size: int
    epochs: int
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    #: (optimizer, total_steps, steps_per_epoch) -> scheduler stepped after every optimizer step
    schedule: Callable[[torch.optim.Optimizer, int, int], Any]
    static_depth: int
    static_at_epoch: float
    collate: Callable | None = None
    augment: Callable | None = None
    variants: int | None = None
    varlen: ac.VarLen | None = None
    eval_batch_size: int = 256
    evals_per_epoch: int = 1
    seed: int = 0


@dataclass
class EvalPoint:
    step: int
    epoch: float
    train_s: float
    wall_s: float
    metric: float
    frozen: int
    loss: float


@dataclass
class RunResult:
    workload: str
    mode: str
    cache: bool
    metric_name: str
    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0
    #: CPU seconds of this process while training (evaluation excluded): less sensitive than wall
    #: time to other jobs on the machine; bench_train adds the daemon's in daemon_cpu_s.
    cpu_s: float = 0.0
    daemon_cpu_s: float = 0.0
    evals: list[EvalPoint] = field(default_factory=list)
    split_s: dict[str, float] = field(default_factory=dict)
    cache_stats: dict[str, float] = field(default_factory=dict)
    timeline: list[dict[str, float]] = field(default_factory=list)
    #: ``Freezer.close()``: the mode's settings and, for the controller modes, its decisions.
    freezer: dict[str, Any] = field(default_factory=dict)
    #: With a cost model: each change of plan (step, frozen depth, mode, cache depth, cached share, reason).
    plans: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final_metric(self) -> float:
        return self.evals[-1].metric if self.evals else math.nan

    @property
    def best_metric(self) -> float:
        return max((p.metric for p in self.evals), default=math.nan)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(final_metric=self.final_metric, best_metric=self.best_metric)
        return out


def matthews(pred: torch.Tensor, gold: torch.Tensor) -> float:
    """Matthews correlation of binary predictions (0 when a row or column of the confusion matrix is empty)."""
    def count(p: int, g: int) -> float:
        return float(((pred == p) & (gold == g)).sum())

    tp, tn, fp, fn = count(1, 1), count(0, 0), count(1, 0), count(0, 1)
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / denom if denom else 0.0


def _to(state: torch.Tensor | tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor | tuple[torch.Tensor, ...]:
    if isinstance(state, tuple):
        return tuple(t.to(device, non_blocking=True) for t in state)
    return state.to(device, non_blocking=True)


def evaluate(staged: ac.StagedModel, loader: DataLoader, metric: str, device: torch.device | str = "cpu") -> float:
    """The dev metric in points; runs every stage in eval mode (on ``device``) and restores train mode."""
    staged.eval()
    device = torch.device(device)
    preds, golds = [], []
    with torch.no_grad():
        for x, y in loader:
            preds.append(staged.run(_to(x, device)).argmax(-1).cpu())
            golds.append(y)
    staged.train()
    pred, gold = torch.cat(preds), torch.cat(golds)
    if metric == "mcc":
        return 100 * matthews(pred, gold)
    return 100 * float((pred == gold).float().mean())


def _active(staged: ac.StagedModel) -> int:
    return sum(p.numel() for p in staged.parameters() if p.requires_grad)


class TrainingRun:
    """One run of a workload, advanced in slices so runs can take turns on a shared machine.

    ``slices()`` yields after every evaluation (and every ``slice_steps``
    steps if given), with this run's puts flushed, so of this run only the
    daemon's read-ahead of its pushed order can run during another run's
    turn. Its clocks (training wall and CPU seconds, evaluation excluded)
    advance only during its own slices, and it keeps its own torch RNG
    state (dropout: the CPU's and, on CUDA, the device's), so interleaved
    runs compute what they would alone. ``device``: where the model trains
    (batches, served entries and evaluation inputs go there).
    ``loader_workers``: the training loader's worker processes (kept across
    epochs). As with any DataLoader, the shuffle order after the first epoch
    depends on it, so compare runs made with the same number.
    The freezer is started with the run's model and optimizer here and
    closed when ``slices()`` ends, also when it fails or is abandoned; time
    spent in its hooks counts as "other" in the split.
    """

    def __init__(
        self,
        workload: Workload,
        freezer: Freezer,
        connection: ac.Connection | None,
        *,
        max_steps: int | None = None,
        on_step: Callable[[int, int, float, ac.CachedForward], None] | None = None,
        on_eval: Callable[[EvalPoint], None] | None = None,
        slice_steps: int | None = None,
        store_dtype: torch.dtype | None = None,
        planner: bool = False,
        device: torch.device | str = "cpu",
        loader_workers: int = 0,
    ) -> None:
        w = self.workload = workload
        self.slice_steps = slice_steps
        self.freezer, self.connection, self.on_step, self.on_eval = freezer, connection, on_step, on_eval
        self.device = torch.device(device)
        torch.manual_seed(w.seed)
        self.staged = w.stage(w.build()).to(self.device)
        cost_model = ac.CachePlanner(ac.PlannerConfig(total_epochs=w.epochs)) if planner and connection else None
        self.model = ac.CachedForward(self.staged, connection, varlen=w.varlen, store_dtype=store_dtype,
                                      planner=cost_model)
        self.loader = ac.CachedLoader(
            # targets: the inputs of samples the cache serves are not loaded
            DataLoader(ac.IndexedDataset(w.train_set, augment=w.augment, targets=getattr(w.train_set, "labels", None)),
                       batch_size=w.batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(w.seed), collate_fn=w.collate,
                       num_workers=loader_workers, persistent_workers=loader_workers > 0,
                       pin_memory=self.device.type == "cuda"),
            self.model, variants=w.variants)
        self.eval_loader = DataLoader(w.eval_set, batch_size=w.eval_batch_size, collate_fn=w.collate)
        self.opt = w.optimizer(self.staged.parameters())
        self.per_epoch = len(self.loader)
        self.total = w.epochs * self.per_epoch if max_steps is None else min(max_steps, w.epochs * self.per_epoch)
        self.scheduler = w.schedule(self.opt, self.total, self.per_epoch)
        freezer.start(self.model, self.opt, steps_per_epoch=self.per_epoch, total_steps=self.total)
        self.result = RunResult(w.name, freezer.name, connection is not None, w.metric)
        if cost_model is not None:
            cost_model.listeners.append(self._record_plan)
        self.split = dict.fromkeys(("data", "backward", "optimizer", "eval"), 0.0)
        self._rng = self._rng_state()
        self._wall = self._cpu = self._eval_cpu = 0.0  # accumulated over this run's slices
        self._resumed = self._resumed_cpu = 0.0
        self._step = 0

    def _record_plan(self, frozen: int, plan: ac.cost_model.Plan) -> None:
        """Keep a plan that changes what is cached: mode, depth, or the cached share by 10 points or more
        (in a last epoch the share follows what is already stored, step by step)."""
        entry = {"frozen": frozen, "mode": plan.mode.name.lower(), "cache_depth": plan.cache_depth}
        last = self.result.plans[-1] if self.result.plans else None
        if (last is None or any(last[k] != v for k, v in entry.items())
                or abs(last["cached_fraction"] - plan.cached_fraction) >= 0.1):
            self.result.plans.append({"step": self._step, **entry, "cached_fraction": round(plan.cached_fraction, 3),
                                      "reason": plan.reason})

    def _now(self) -> float:
        """Wall seconds this run has been active, evaluation included."""
        return self._wall + time.perf_counter() - self._resumed

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The CPU generator's state and, training on CUDA, the device's (dropout draws from it there)."""
        on_cuda = self.device.type == "cuda"
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if on_cuda else None

    def _resume(self) -> None:
        cpu, cuda = self._rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        self._resumed, self._resumed_cpu = time.perf_counter(), time.process_time()

    def _pause(self) -> None:
        if self.connection is not None:
            self.connection.flush(timeout_s=60)  # counted in this run's time, not the next run's
        self._wall += time.perf_counter() - self._resumed
        self._cpu += time.process_time() - self._resumed_cpu
        self._rng = self._rng_state()

    def _record(self, step: int, epoch: float, loss: float) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        metric = evaluate(self.staged, self.eval_loader, self.workload.metric, self.device)
        self.split["eval"] += time.perf_counter() - t0
        self._eval_cpu += time.process_time() - c0
        now = self._now()
        point = EvalPoint(step, epoch, now - self.split["eval"], now, metric, self.model.frozen, loss)
        self.result.evals.append(point)
        if self.on_eval:
            self.on_eval(point)

    def _mark(self, step: int, epoch: float, total_params: int) -> None:
        self.result.timeline.append({"step": step, "epoch": epoch, "frozen": self.model.frozen,
                                     "train_s": self._now() - self.split["eval"],
                                     "active_params": _active(self.staged), "total_params": total_params})

    def slices(self) -> Iterator[None]:
        """Train to the end, yielding after each evaluation; ``result`` is complete when it returns."""
        try:
            yield from self._slices()
        finally:
            self.result.freezer = self.freezer.close()

    def _slices(self) -> Iterator[None]:
        w, model, split, per_epoch = self.workload, self.model, self.split, self.per_epoch
        stats0 = dataclasses.replace(self.connection.stats) if self.connection is not None else None
        eval_at = {min(per_epoch, round(per_epoch * (k + 1) / w.evals_per_epoch)) for k in range(w.evals_per_epoch)}
        total_params, loss_sum, loss_n, last_loss, step = _active(self.staged), 0.0, 0, None, 0
        self._resume()
        self.staged.train()
        for epoch in range(w.epochs):
            batches = iter(self.loader)  # run to exhaustion every epoch: CachedLoader then moves to the next
            for position in range(per_epoch + 1):
                info = StepInfo(step, epoch + position / per_epoch, self.opt.param_groups[0]["lr"], last_loss)
                self._step = step  # for the plans recorded during it
                frozen = model.frozen
                if position < per_epoch and step < self.total:
                    self.freezer.before_step(info, model)
                if model.frozen != frozen or step == 0 and position == 0:
                    self._mark(step, info.epoch, total_params)
                t0 = time.perf_counter()
                batch = next(batches, None)
                split["data"] += time.perf_counter() - t0
                if batch is None or step >= self.total:
                    break
                loss = nn.functional.cross_entropy(model(batch), batch.data[1].to(self.device, non_blocking=True))
                self.opt.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                loss.backward()
                t1 = time.perf_counter()
                self.freezer.after_backward(info, model)
                t2 = time.perf_counter()
                self.opt.step()
                self.scheduler.step()
                split["optimizer"] += time.perf_counter() - t2
                split["backward"] += t1 - t0
                last_loss = loss.item()
                loss_sum, loss_n, step = loss_sum + last_loss, loss_n + 1, step + 1
                self.result.samples += len(batch.ids)
                if self.on_step:
                    self.on_step(step, self.total, last_loss, model)
                evaluate_now = position + 1 in eval_at or step == self.total
                if evaluate_now:
                    self._record(step, epoch + (position + 1) / per_epoch, loss_sum / loss_n)
                    loss_sum, loss_n = 0.0, 0
                if evaluate_now or self.slice_steps and step % self.slice_steps == 0:
                    self._pause()
                    yield
                    self._resume()
            if step >= self.total:
                break
        self._finish(step, stats0)

    def _finish(self, step: int, stats0: ac.ClientStats | None) -> None:
        self._pause()
        r, t, split = self.result, self.model.times, self.split
        r.steps, r.wall_s = step, self._wall
        r.train_s = r.wall_s - split["eval"]
        r.cpu_s = self._cpu - self._eval_cpu
        split.update(fetch_wait=t.fetch_wait, prefix=t.prefix, suffix_forward=t.suffix_forward)
        split["other"] = r.train_s - sum(v for k, v in split.items() if k != "eval")
        r.split_s = split
        r.cache_stats = _cache_stats(self.connection, stats0, t)


def train(workload: Workload, freezer: Freezer, connection: ac.Connection | None, **options: Any) -> RunResult:
    """One run from start to end (options as for :class:`TrainingRun`; ``max_steps`` cuts it short)."""
    run = TrainingRun(workload, freezer, connection, **options)
    collections.deque(run.slices(), maxlen=0)  # run every slice to the end
    return run.result


def interleave(runs: Sequence[TrainingRun]) -> list[RunResult]:
    """Advance ``runs`` a slice each in turn until all are done: machine load drifts hit them alike."""
    pending = [(run, run.slices()) for run in runs]
    while pending:
        pending = [(run, slices) for run, slices in pending if next(slices, StopIteration) is not StopIteration]
    return [run.result for run in runs]


def _cache_stats(connection: ac.Connection | None, before: ac.ClientStats | None, times: ac.StepTimes) -> dict[str, float]:
    """Per-sample counts of the frozen prefix (hit ratio: served / needed) and the connection's traffic."""
    needed = times.cached_samples + times.computed_samples + times.seeded_samples
    out = {"cached_samples": times.cached_samples, "computed_samples": times.computed_samples,
           "seeded_samples": times.seeded_samples, "hits": times.cached_samples,
           "hit_ratio": times.cached_samples / needed if needed else 0.0}
    if connection is None or before is None:
        return {**out, "gets": 0, "streamed": 0, "bytes_written": 0, "bytes_read": 0, "puts": 0, "puts_dropped": 0}
    connection.flush(timeout_s=60)
    s = connection.stats
    return {**out, "gets": s.gets - before.gets, "streamed": s.streamed - before.streamed,
            "bytes_written": s.bytes_written - before.bytes_written,
            "bytes_read": s.bytes_read - before.bytes_read, "puts": s.puts - before.puts,
            "puts_dropped": s.puts_dropped - before.puts_dropped}
