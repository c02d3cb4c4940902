"""Time to target, the comparison table, and the JSON/CSV results of a benchmark invocation.

The target is the full run's best dev metric minus a tolerance (points).
A run's time to target is the training clock (evaluation excluded) at its
first evaluation at or above the target. Speedups are the full run's time
over the run's own, measured in the same invocation. CPU seconds (trainer
process plus, for cached runs, the daemon) are reported beside wall time:
on a machine shared with other jobs they move less than wall time does.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

from .trainer import RunResult

__all__ = ["SPLIT_KEYS", "format_decisions", "format_plans", "format_table", "label", "summarize", "time_to_target",
           "write_results"]

SPLIT_KEYS = ("data", "fetch_wait", "prefix", "suffix_forward", "backward", "optimizer", "other")


def label(run: RunResult) -> str:
    return run.mode if run.mode == "full" else f"{run.mode}+{'cache' if run.cache else 'nocache'}"


def time_to_target(run: RunResult, target: float) -> float:
    """Training seconds until the metric first reached ``target`` (nan if it never did)."""
    return next((p.train_s for p in run.evals if p.metric >= target), math.nan)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def summarize(runs: Sequence[RunResult], tolerance: float) -> tuple[float, list[dict[str, Any]]]:
    """The target and one row per run; ``runs[0]`` must be the full run."""
    full = runs[0]
    if full.mode != "full":
        raise ValueError(f"the first run must be the full baseline, got {label(full)}")
    target = full.best_metric - tolerance
    base_tta = time_to_target(full, target)
    rows = []
    for run in runs:
        tta = time_to_target(run, target)
        c = run.cache_stats
        rows.append({
            "run": label(run), "metric": run.metric_name, "final": run.final_metric, "best": run.best_metric,
            "metric_delta": run.final_metric - full.final_metric, "tta_s": tta, "tta_speedup": _ratio(base_tta, tta),
            "train_s": run.train_s, "wall_s": run.wall_s, "speedup": _ratio(full.train_s, run.train_s),
            "cpu_s": run.cpu_s + run.daemon_cpu_s, "cpu_speedup": _ratio(full.cpu_s + full.daemon_cpu_s,
                                                                         run.cpu_s + run.daemon_cpu_s),
            "hit_ratio": c.get("hit_ratio", 0.0), "mb_written": c.get("bytes_written", 0) / 1e6,
            "mb_read": c.get("bytes_read", 0) / 1e6, "steps": run.steps, "samples": run.samples,
            **{f"{k}_s": run.split_s.get(k, 0.0) for k in SPLIT_KEYS}, "eval_s": run.split_s.get("eval", 0.0),
        })
    return target, rows


def _fmt(value: Any, spec: str) -> str:
    """``format(value, spec)``, or a dash as wide for nan (never reached, no baseline)."""
    if isinstance(value, float) and math.isnan(value):
        return "-".rjust(int(spec.lstrip("+").split(".")[0]))
    return format(value, spec)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Two aligned tables: outcome per run, then where its training time went (seconds)."""
    w = max([16, *(len(r["run"]) + 2 for r in rows)])  # "autofreeze+nocache" is 18 characters
    head = (f"{'run':<{w}}{'final':>8}{'best':>8}{'delta':>8}{'TTA s':>9}{'train s':>9}{'wall s':>9}"
            f"{'speedup':>9}{'TTA x':>8}{'CPU s':>8}{'CPU x':>7}{'hits':>7}{'MB wr':>8}{'MB rd':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['run']:<{w}}{_fmt(r['final'], '8.2f')}{_fmt(r['best'], '8.2f')}{_fmt(r['metric_delta'], '+8.2f')}"
                     f"{_fmt(r['tta_s'], '9.1f')}{r['train_s']:>9.1f}{r['wall_s']:>9.1f}{_fmt(r['speedup'], '8.2f')}x"
                     f"{_fmt(r['tta_speedup'], '7.2f')}x{r['cpu_s']:>8.0f}{_fmt(r['cpu_speedup'], '6.2f')}x"
                     f"{r['hit_ratio']:>7.0%}{r['mb_written']:>8.0f}{r['mb_read']:>8.0f}")
    lines += ["", f"{'time split (s)':<{w}}" + "".join(f"{k:>15}" for k in (*SPLIT_KEYS, "eval"))]
    for r in rows:
        lines.append(f"{r['run']:<{w}}" + "".join(f"{r[f'{k}_s']:>15.1f}" for k in (*SPLIT_KEYS, "eval")))
    return "\n".join(lines)


def format_decisions(runs: Sequence[RunResult]) -> str:
    """Each controller run's freezes and unfreezes (step, epoch, stage, depth after, reason); "" if none ran."""

    def what(d: dict[str, Any]) -> str:
        return f"freeze stage {d['stage']} ({d['stage_name']})" if d["decision"] == "freeze_next" else "unfreeze all"

    width = max((len(what(d)) for run in runs for d in run.freezer.get("decisions", ())), default=0)
    lines = []
    for run in runs:
        f = run.freezer
        if "decisions" not in f:
            continue
        head = (f"{label(run)}: {len(f['decisions'])} freeze decision(s) in {f['evaluations']} evaluations "
                f"(every {f['eval_every']} steps), {f['final_frozen']} stage(s) frozen at the end")
        ref = f.get("reference_stats")
        if ref is not None:
            head += (f"; reference: {ref['readings']} readings of {ref['submitted']} probes, skipped "
                     f"{ref['skipped_full']} (queue full) and {ref['skipped_busy']} (CPU busy)")
        lines.append(head)
        for d in f["decisions"]:
            lines.append(f"  step {d['step']:>5} (epoch {d['epoch']:5.2f}): {what(d):<{width}} -> "
                         f"{d['frozen']:>2} frozen, {d['active_param_share']:6.1%} of parameters training: "
                         f"{d['reason']}")
    return "\n".join(lines)


def format_plans(runs: Sequence[RunResult]) -> str:
    """Each cached run's plans from the cost model (step, frozen depth, what it decided, why); "" if none."""
    lines = []
    for run in runs:
        if run.plans:
            lines.append(f"{label(run)}: {len(run.plans)} plan(s) from the cost model")
            lines += [f"  step {p['step']:>5}: frozen {p['frozen']}: {p['reason']}" for p in run.plans]
    return "\n".join(lines)


def write_results(directory: Path, stem: str, payload: dict[str, Any], rows: Sequence[dict[str, Any]]) -> Path:
    """``<stem>-<timestamp>.json`` (everything) and ``.csv`` (the summary rows); returns the JSON path."""
    directory.mkdir(parents=True, exist_ok=True)
    base = directory / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    payload = {**payload, "load_average_end": os.getloadavg()}
    base.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    with base.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return base.with_suffix(".json")
