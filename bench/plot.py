"""Dev metric vs training time for every run of bench_train results, and the active-parameter timeline.

    python bench/plot.py [RESULT.json ...] [--out bench/results/train.png]

With no file, plots the newest bench/results/train-*.json of each workload.
One figure row per workload: left, the dev metric of each run (full,
static+cache, static+nocache, ...) against its training clock (evaluation
excluded) with the full run's target as a dashed line (Egeria Fig. 8 style);
right, the share of parameters still training, from each run's timeline of
frozen depth: it steps down at every freeze and, for Egeria, back up at an
unfreeze (the decisions themselves are in ``runs[i].freezer``). Needs
matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def newest_per_workload(directory: Path) -> list[Path]:
    newest: dict[str, Path] = {}
    for path in sorted(directory.glob("train-*.json")):  # names end in a sortable timestamp
        newest[path.name.split("-")[1]] = path
    return list(newest.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=RESULTS / "train.png")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        parser.error("needs matplotlib: pip install -e '.[plot]'")
    paths = args.results or newest_per_workload(RESULTS)
    if not paths:
        parser.error(f"no results given and none in {RESULTS}; run bench/bench_train.py first")
    payloads = [json.loads(p.read_text()) for p in paths]
    fig, axes = plt.subplots(len(payloads), 2, figsize=(11, 3.6 * len(payloads)), squeeze=False)
    for (left, right), payload in zip(axes, payloads):
        runs = payload["runs"]
        workload, metric = runs[0]["workload"], runs[0]["metric_name"]
        for run, row in zip(runs, payload["summary"]):
            name = row["run"]
            left.plot([p["train_s"] for p in run["evals"]], [p["metric"] for p in run["evals"]], marker="o", ms=3,
                      label=f"{name} ({run['train_s']:.0f} s)")
            timeline = run["timeline"] + [{**run["timeline"][-1], "train_s": run["train_s"]}]
            right.step([t["train_s"] for t in timeline], [100 * t["active_params"] / t["total_params"] for t in timeline],
                       where="post", label=name)
        left.axhline(payload["target"], color="grey", ls="--", lw=1, label=f"target {payload['target']:.2f}")
        left.set(title=f"{workload}: dev {metric} vs training time", xlabel="training time (s, evaluation excluded)",
                 ylabel=f"{metric} (points)")
        right.set(title=f"{workload}: parameters training", xlabel="training time (s)", ylabel="% of parameters",
                  ylim=(0, 105))
        left.legend(fontsize=8)
        right.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({', '.join(p.name for p in paths)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
