"""Time to accuracy: full training vs a freeze mode, with and without the activation cache, in one invocation.

    python bench/bench_train.py --workload {cifar,digits,sst2,cola,mrpc} --mode {full,static,auto,autofreeze,egeria}
                                [--cache | --no-cache] [--quick] [--seeds S [S ...]] [--data-dir DIR] [--threads N]
                                [--device cuda] [--loader-workers N]
                                [--epochs N] [--train-size N] [--eval-size N] [--variants K]
                                [--freeze-depth K] [--freeze-at EPOCHS]     (static)
                                [--eval-every STEPS]                        (auto, autofreeze, egeria)

The full run (it sets the target: its best dev metric minus --tolerance
points), the mode with the cache (a fresh daemon process, Unix socket, LMDB
in a temp dir) and without it (--cache or --no-cache keeps one of the two)
take turns every 5 steps, so drifts in the machine's load hit them alike;
each run's clock counts only its own turns. Results go to bench/results/
(JSON + CSV), one file per seed; each seed's figures are printed, and the
last two lines are the mode's figures against the full run of the same
seed, averaged over the seeds (``--seeds 0 1``: the runs of seed 0, then
those of seed 1; a seed sets the model's initialisation, the data order
and dropout). Sample output and what every column means:

    run                final    best   delta    TTA s  train s   wall s  speedup   TTA x   CPU s  CPU x   hits ...
    full               ...
    static+cache       ...
    static+nocache     ...
    figure: tta_speedup = R
    figure: metric_delta = D

Modes: ``static`` freezes the workload's fixed prefix at a fixed epoch;
``auto`` runs the freeze controller with no policy, as a user gets it from
the run's length (``FreezeController(model, opt, total_steps=N)``);
``autofreeze`` and ``egeria`` run the freeze controller
(``actcache_client.freeze.FreezeController``) with AutoFreeze's or Egeria's
policy at the papers' defaults, evaluating every --eval-every steps (default:
an epoch's steps / 5 for AutoFreeze, from the run's length and stage count for
Egeria; see workloads/freezers.py). Egeria's reference model runs in a
spawned CPU process per run, never waited for. For these modes a list of
every freeze and unfreeze (step, epoch, stage, reason) is printed after the
tables, and the JSON holds it with every policy observation under
``runs[i].freezer``. Their figures are in docs/guides/freeze-policies.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import psutil
import torch
from workloads.data import DataNotFound, resolve_data_dir
from workloads.freezers import MODES, make_freezer
from workloads.report import format_decisions, format_plans, format_table, summarize, write_results
from workloads.tasks import WORKLOADS, make_workload
from workloads.trainer import EvalPoint, RunResult, TrainingRun, Workload, interleave

import actcache_client as ac
from actcache.errors import ConfigError
from actcache.testing import run_daemon

SLICE_STEPS = 5  # the runs take turns every 5 steps (and at every evaluation)
STORE_DTYPES = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}
RESULTS = Path(__file__).resolve().parent / "results"


def label_of(mode: str, cache: bool) -> str:
    return mode if mode == "full" else f"{mode}+{'cache' if cache else 'nocache'}"


def run_all(workload: Workload, plan: list[tuple[str, bool]], args: argparse.Namespace) -> list[RunResult]:
    """The planned (mode, cache) runs, taking turns; each cached run has its own daemon."""
    with contextlib.ExitStack() as stack:
        training, daemons = [], []
        for mode, cache in plan:
            freezer = make_freezer(mode, static_depth=args.freeze_depth or workload.static_depth,
                                   static_at_epoch=workload.static_at_epoch if args.freeze_at is None else args.freeze_at,
                                   eval_every=args.eval_every)
            conn = None
            if cache:
                daemon = stack.enter_context(run_daemon())
                conn = stack.enter_context(ac.connect(daemon.socket, namespace=f"bench-{workload.name}", timeout_s=60))
                daemons.append((len(training), psutil.Process(daemon.pid)))
            training.append(TrainingRun(workload, freezer, conn, on_eval=_printer(label_of(mode, cache), workload),
                                        slice_steps=SLICE_STEPS, store_dtype=STORE_DTYPES[args.store_dtype],
                                        planner=args.planner, device=args.device,
                                        loader_workers=args.loader_workers))
        before = {i: _cpu(p) for i, p in daemons}
        results = interleave(training)
        for i, process in daemons:
            results[i].daemon_cpu_s = _cpu(process) - before[i]
    return results


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _printer(name: str, workload: Workload):
    def on_eval(p: EvalPoint) -> None:
        print(f"  [{name}] epoch {p.epoch:5.2f} step {p.step:>5}  train {p.train_s:7.1f}s  loss {p.loss:.3f}  "
              f"{workload.metric} {p.metric:6.2f}  frozen {p.frozen}", flush=True)

    return on_eval


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--mode", choices=MODES, default="static")
    parser.add_argument("--cache", action=argparse.BooleanOptionalAction, default=None,
                        help="only with (--cache) or only without (--no-cache) the cache; default: both")
    parser.add_argument("--quick", action="store_true", help="small data and few epochs: a minute or two per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one set of runs per seed (model "
                        "initialisation, data order, dropout); the figures are means over the seeds (default: 0)")
    parser.add_argument("--data-dir", help="default: $ACTCACHE_DATA, else ../shared/data beside the repository")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--train-size", type=int, help="training samples (fixed-seed subset)")
    parser.add_argument("--eval-size", type=int, help="dev/test samples (fixed-seed subset)")
    parser.add_argument("--freeze-depth", type=int, help="static mode: stages to freeze (default per workload)")
    parser.add_argument("--freeze-at", type=float, help="static mode: when, in (fractional) epochs")
    parser.add_argument("--eval-every", type=int, help="auto/autofreeze/egeria: steps between the policy's "
                        "evaluations (default: an epoch's steps / 5 for autofreeze; from the run's length for "
                        "auto and egeria)")
    parser.add_argument("--planner", action=argparse.BooleanOptionalAction, default=True,
                        help="cached runs let the cost model (CachePlanner) decide whether and where caching pays, "
                             "as a user would (default); --no-planner caches every frozen prefix")
    parser.add_argument("--variants", type=int, help="cached augmentation variants per sample in every run (epoch e "
                        "uses variant e %% K; workloads with augmentation: cifar, default 2)")
    parser.add_argument("--tolerance", type=float, default=0.3, help="target = full run's best minus this (points)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--store-dtype", choices=list(STORE_DTYPES), default="float32",
                        help="precision of the cached runs' stored entries (CachedForward(store_dtype=...)); "
                             "mode+cache against mode+nocache is then its effect on the metric")
    parser.add_argument("--threads", type=int, help="torch threads of every run (default: torch's choice); "
                        "on 2 cores, 1 leaves a core to the daemon and the client's I/O threads")
    parser.add_argument("--device", default="cpu", help="where every run trains (cpu, cuda); the reference "
                        "processes of egeria and the daemons stay on the CPU")
    parser.add_argument("--loader-workers", type=int, default=0,
                        help="DataLoader worker processes of every run (default 0: the training thread loads); "
                        "on a GPU the loader bounds a ResNet-20 step")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # fail before loading anything when the mode's settings or the device are invalid
        if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {args.device}: CUDA is not available here")
        if args.loader_workers < 0:
            raise ConfigError(f"--loader-workers {args.loader_workers}: give 0 or more")
        make_freezer(args.mode, static_depth=args.freeze_depth or 1, static_at_epoch=args.freeze_at or 0,
                     eval_every=args.eval_every)
        data_dir = None if args.workload == "digits" else resolve_data_dir(args.data_dir)  # digits: scikit-learn's
        sizes = {k: v for k, v in (("epochs", args.epochs), ("train_size", args.train_size),
                                   ("eval_size", args.eval_size)) if v is not None}
        workload = make_workload(args.workload, data_dir, quick=args.quick, **sizes)
        if args.variants is not None:
            if workload.augment is None or args.variants < 1:
                raise ConfigError(f"--variants {args.variants}: give K >= 1 for a workload with augmentation "
                                  f"({args.workload} has {'some' if workload.augment else 'none'})")
            workload.variants = args.variants
    except (ConfigError, DataNotFound, ModuleNotFoundError) as exc:
        print(f"bench_train: {exc}", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    source = data_dir or "scikit-learn"
    print(f"{args.workload}: {len(workload.train_set)} train / {len(workload.eval_set)} eval samples from {source}; "
          f"{torch.get_num_threads()} threads; on {args.device}; load average {load_start[0]:.1f} (other jobs make times noisy)")
    plan = [("full", False)]
    if args.mode != "full":
        plan += [(args.mode, cache) for cache in ((True, False) if args.cache is None else (args.cache,))]
    print(f"runs: {', '.join(label_of(*p) for p in plan)}, taking turns every {SLICE_STEPS} steps", flush=True)
    figures = []
    for seed in args.seeds:
        workload.seed = seed
        print(f"\nseed {seed}", flush=True)
        rows = run_seed(workload, plan, args, source)
        primary = rows[1] if len(rows) > 1 else rows[0]
        figures.append((primary["tta_speedup"], primary["metric_delta"]))
        print(f"seed {seed}: {primary['run']} against full: tta_speedup {primary['tta_speedup']:.2f}, "
              f"metric_delta {primary['metric_delta']:+.2f}", flush=True)
    if len(plan) > 1:
        print(f"\nfigures are for {label_of(*plan[1])} against full, means over seeds {args.seeds}")
    print(f"figure: tta_speedup = {sum(f[0] for f in figures) / len(figures):.2f}")
    print(f"figure: metric_delta = {sum(f[1] for f in figures) / len(figures):.2f}")
    return 0


def run_seed(workload: Workload, plan: list[tuple[str, bool]], args: argparse.Namespace,
             source: object) -> list[dict]:
    """The planned runs of one seed: tables, decisions and plans printed, results written; the summary rows."""
    load_start = os.getloadavg()
    runs = run_all(workload, plan, args)
    target, rows = summarize(runs, args.tolerance)
    print(f"\ntarget {workload.metric} {target:.2f} (full run's best {runs[0].best_metric:.2f} - {args.tolerance})")
    print(format_table(rows))
    for section in (format_decisions(runs), format_plans(runs)):
        if section:
            print(f"\n{section}")
    payload = {"command": " ".join(sys.argv), "args": vars(args), "seed": workload.seed, "data_dir": str(source),
               "target": target, "threads": torch.get_num_threads(), "load_average_start": load_start,
               "summary": rows, "runs": [r.to_dict() for r in runs]}
    path = write_results(args.results_dir, f"train-{args.workload}-{args.mode}-seed{workload.seed}", payload, rows)
    print(f"results: {path}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
