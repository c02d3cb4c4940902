"""One training run of a workload under a freezer, with or without the cache, measured.

``train(workload, freezer, connection)`` runs the workload's epochs through
``CachedForward`` + ``CachedLoader`` (with ``connection=None`` the frozen
prefix is recomputed every step, so a run with and without the cache is the
same computation), evaluates the dev metric ``evals_per_epoch`` times per
epoch, and returns a :class:`RunResult`: metric curve on the training clock
(wall time minus evaluation), time split, cache counters and the timeline of
frozen depth and active parameters.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac

from .freezers import Freezer, StepInfo

__all__ = ["EvalPoint", "RunResult", "Workload", "evaluate", "matthews", "train"]


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
    tp = float(((pred == 1) & (gold == 1)).sum()); tn = float(((pred == 0) & (gold == 0)).sum())
    fp = float(((pred == 1) & (gold == 0)).sum()); fn = float(((pred == 0) & (gold == 1)).sum())
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / denom if denom else 0.0


def evaluate(staged: ac.StagedModel, loader: DataLoader, metric: str) -> float:
    """The dev metric in points; runs every stage in eval mode and restores train mode."""
    staged.eval()
    preds, golds = [], []
    with torch.no_grad():
        for x, y in loader:
            preds.append(staged.run(x).argmax(-1))
            golds.append(y)
    staged.train()
    pred, gold = torch.cat(preds), torch.cat(golds)
    if metric == "mcc":
        return 100 * matthews(pred, gold)
    return 100 * float((pred == gold).float().mean())


def _active(staged: ac.StagedModel) -> int:
    return sum(p.numel() for p in staged.parameters() if p.requires_grad)


def train(
    workload: Workload,
    freezer: Freezer,
    connection: ac.Connection | None,
    *,
    max_steps: int | None = None,
    on_step: Callable[[int, int, float, ac.CachedForward], None] | None = None,
    on_eval: Callable[[EvalPoint], None] | None = None,
) -> RunResult:
    """Train ``workload`` from its seed; ``max_steps`` cuts the run short (tests)."""
    w = workload
    torch.manual_seed(w.seed)
    staged = w.stage(w.build())
    model = ac.CachedForward(staged, connection, varlen=w.varlen)
    loader = ac.CachedLoader(
        DataLoader(ac.IndexedDataset(w.train_set, augment=w.augment), batch_size=w.batch_size, shuffle=True,
                   generator=torch.Generator().manual_seed(w.seed), collate_fn=w.collate),
        model, variants=w.variants)
    eval_loader = DataLoader(w.eval_set, batch_size=w.eval_batch_size, collate_fn=w.collate)
    opt = w.optimizer(staged.parameters())
    per_epoch = len(loader)
    total = w.epochs * per_epoch if max_steps is None else min(max_steps, w.epochs * per_epoch)
    scheduler = w.schedule(opt, total, per_epoch)
    eval_at = {min(per_epoch, round(per_epoch * (k + 1) / w.evals_per_epoch)) for k in range(w.evals_per_epoch)}
    result = RunResult(w.name, freezer.name, connection is not None, w.metric)
    split = dict.fromkeys(("data", "backward", "optimizer", "eval"), 0.0)
    stats0 = dataclasses.replace(connection.stats) if connection is not None else None
    total_params, loss_sum, loss_n, last_loss = _active(staged), 0.0, 0, None
    start, cpu_start, eval_cpu = time.perf_counter(), time.process_time(), 0.0

    def record(step: int, epoch: float) -> None:
        nonlocal eval_cpu
        t0, c0 = time.perf_counter(), time.process_time()
        metric = evaluate(staged, eval_loader, w.metric)
        split["eval"] += time.perf_counter() - t0
        eval_cpu += time.process_time() - c0
        now = time.perf_counter() - start
        point = EvalPoint(step, epoch, now - split["eval"], now, metric, model.frozen,
                          loss_sum / loss_n if loss_n else math.nan)
        result.evals.append(point)
        if on_eval:
            on_eval(point)

    step = 0
    staged.train()
    for epoch in range(w.epochs):
        batches = iter(loader)  # run to exhaustion every epoch: CachedLoader then moves to the next epoch
        for position in range(per_epoch + 1):
            info = StepInfo(step, epoch + position / per_epoch, opt.param_groups[0]["lr"], last_loss)
            frozen = model.frozen
            if position < per_epoch and step < total:
                freezer.before_step(info, model)
            if model.frozen != frozen or step == 0 and position == 0:
                result.timeline.append({"step": step, "epoch": info.epoch, "frozen": model.frozen,
                                        "train_s": time.perf_counter() - start - split["eval"],
                                        "active_params": _active(staged), "total_params": total_params})
            t0 = time.perf_counter()
            batch = next(batches, None)
            split["data"] += time.perf_counter() - t0
            if batch is None or step >= total:
                break
            x, y = batch.data
            loss = nn.functional.cross_entropy(model(batch.ids, x, variant=batch.variant), y)
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            freezer.after_backward(info, model)
            t2 = time.perf_counter()
            opt.step()
            scheduler.step()
            split["optimizer"] += time.perf_counter() - t2
            split["backward"] += t1 - t0
            last_loss = loss.item()
            loss_sum, loss_n = loss_sum + last_loss, loss_n + 1
            step += 1
            result.samples += len(batch.ids)
            if on_step:
                on_step(step, total, last_loss, model)
            if position + 1 in eval_at or step == total:
                record(step, epoch + (position + 1) / per_epoch)
                loss_sum, loss_n = 0.0, 0
        if step >= total:
            break
        if connection is not None:
            connection.flush(timeout_s=60)  # the next epoch's lookups see this epoch's puts
    result.wall_s = time.perf_counter() - start
    result.train_s = result.wall_s - split["eval"]
    result.cpu_s = time.process_time() - cpu_start - eval_cpu
    result.steps = step
    t = model.times
    split.update(fetch_wait=t.fetch_wait, prefix=t.prefix, suffix_forward=t.suffix_forward)
    split["other"] = result.train_s - sum(v for k, v in split.items() if k != "eval")
    result.split_s = split
    result.cache_stats = _cache_stats(connection, stats0, t)
    return result


def _cache_stats(connection: ac.Connection | None, before: ac.ClientStats | None, times: ac.StepTimes) -> dict[str, float]:
    """Per-sample counts of the frozen prefix (hit ratio: served / needed) and the connection's traffic."""
    needed = times.cached_samples + times.computed_samples + times.seeded_samples
    out = {"cached_samples": times.cached_samples, "computed_samples": times.computed_samples,
           "seeded_samples": times.seeded_samples, "hits": times.cached_samples,
           "hit_ratio": times.cached_samples / needed if needed else 0.0}
    if connection is None or before is None:
        return {**out, "lookups": 0, "bytes_written": 0, "bytes_read": 0, "puts": 0, "puts_dropped": 0}
    connection.flush(timeout_s=60)
    s = connection.stats
    return {**out, "lookups": s.lookups - before.lookups, "bytes_written": s.bytes_written - before.bytes_written,
            "bytes_read": s.bytes_read - before.bytes_read, "puts": s.puts - before.puts,
            "puts_dropped": s.puts_dropped - before.puts_dropped}
