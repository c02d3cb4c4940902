"""Would an accuracy guard help? Its rule replayed on the dev-metric curves that bench_train.py recorded.

    python bench/bench_guard.py RESULTS.json [RESULTS.json ...] [--tolerance 0.3 1.0 2.0]

The guard considered for ``FreezeController``: after a freeze, a reported
dev metric more than ``tolerance`` points below the best one reported before
the freeze undoes it. No training here: the script reads the evaluation
series of ``bench_train.py`` results (one file per seed: the full run and the
freeze runs of that seed) and asks two questions.

- **Noise.** A freeze that changes nothing would see the full run's own
  curve. In each full run, the largest fall of the metric below its best so
  far, over the evaluations from the first freeze of that seed's freeze runs
  on: a tolerance below it undoes a harmless freeze on noise alone.
  ``figure: guard_noise_drop`` is the largest over the files.
- **Losses.** For each freeze run, the replayed rule at each tolerance:
  whether and where it would have fired, and the run's final metric against
  the full run of the same seed. A guard helps only where it fires on the
  runs that lost (final delta below -0.3) and not on the others.
  ``figure: guard_useful_tolerances`` counts the tolerances at which it fires
  on every losing run and on no other.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

LOSS = 0.3  # points: "equal accuracy", the margin bench_train.py's target allows


def noise_drop(evals: list[dict[str, Any]], start_step: int) -> float:
    """The largest fall of the metric below its best so far, at evaluations from ``start_step`` on."""
    best, drop = float("-inf"), 0.0
    for e in evals:
        if e["step"] >= start_step:
            drop = max(drop, best - e["metric"])
        best = max(best, e["metric"])
    return drop


def first_firing(evals: list[dict[str, Any]], tolerance: float) -> dict[str, Any] | None:
    """The guard's rule on a recorded run: the first evaluation after a freeze that falls more than
    ``tolerance`` below the best metric reported at a shallower frozen depth; None if none does."""
    best_at: dict[int, float] = {}
    for e in evals:
        depth = e["frozen"]
        before = [m for d, m in best_at.items() if d < depth]
        if before and e["metric"] < max(before) - tolerance:
            return {"step": e["step"], "epoch": e["epoch"], "metric": e["metric"], "reference": max(before),
                    "frozen": depth}
        best_at[depth] = max(best_at.get(depth, float("-inf")), e["metric"])
    return None


FreezeRun = tuple[str, float, list[dict[str, Any]]]  # label, final delta against the full run, evaluations


def load(paths: list[Path]) -> tuple[list[float], list[FreezeRun]]:
    """Each file's noise drop (files where nothing froze are skipped, and say so) and its freeze runs."""
    drops: list[float] = []
    freeze_runs: list[FreezeRun] = []
    for path in paths:
        payload = json.loads(path.read_text())
        full = next(r for r in payload["runs"] if r["mode"] == "full")
        frozen = [r for r in payload["runs"] if r["mode"] != "full" and any(e["frozen"] for e in r["evals"])]
        name = f"{full['workload']} seed {payload['seed']}"
        if not frozen:
            print(f"{name}: {path.name}: nothing froze, skipped")
            continue
        first = min(e["step"] for r in frozen for e in r["evals"] if e["frozen"])
        drops.append(noise_drop(full["evals"], first))
        print(f"{name}: full run {full['final_metric']:.2f}, noise drop {drops[-1]:.2f} points from step {first} "
              f"({len(full['evals'])} evaluations)")
        for run in frozen:
            label = f"{name} {run['mode']}{'+cache' if run['cache'] else ''}"
            freeze_runs.append((label, run["final_metric"] - full["final_metric"], run["evals"]))
    return drops, freeze_runs


def replay(freeze_runs: list[FreezeRun], tolerance: float) -> bool:
    """The rule at ``tolerance`` on every freeze run, printed; whether it fires on every losing run and no other."""
    fired_on_loss = fired_on_other = missed = 0
    for label, delta, evals in freeze_runs:
        fired = first_firing(evals, tolerance)
        lost = delta < -LOSS
        fired_on_loss += bool(fired) and lost
        fired_on_other += bool(fired) and not lost
        missed += (not fired) and lost
        where = (f"fires at step {fired['step']} (epoch {fired['epoch']:.2f}, {fired['metric']:.2f} against "
                 f"{fired['reference']:.2f}, depth {fired['frozen']})" if fired else "never fires")
        print(f"  tolerance {tolerance:g}: {label}: final delta {delta:+.2f}, {where}")
    print(f"tolerance {tolerance:g}: fires on {fired_on_loss} of {fired_on_loss + missed} runs that lost more "
          f"than {LOSS:g}, and on {fired_on_other} that did not")
    return fired_on_loss + missed > 0 and missed == 0 and fired_on_other == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench_train.py JSON results, one per seed")
    parser.add_argument("--tolerance", nargs="+", type=float, default=[0.3, 0.5, 1.0, 1.5, 2.0, 3.0])
    args = parser.parse_args()
    drops, freeze_runs = load(args.results)
    if not freeze_runs:
        parser.error("no run in these results froze anything: pass bench_train.py results of a freeze mode")
    useful = sum(replay(freeze_runs, tolerance) for tolerance in args.tolerance)
    print(f"figure: guard_noise_drop = {max(drops):.2f}")
    print(f"figure: guard_useful_tolerances = {useful}")


if __name__ == "__main__":
    main()
