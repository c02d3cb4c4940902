"""The actcache demo: one small training run twice, every stage training vs the front frozen and served from the cache.

    make demo        (or: python bench/demo.py [--epochs 10] [--freeze-only])

ResNet-20 learns scikit-learn's 1,797 handwritten 8x8 digits (shipped with
the package: nothing is downloaded), upsampled to 32x32. The second run
freezes the stem and the first two residual layers (about 2/3 of the
forward compute) after 30% of the epochs; their outputs are computed once
more, stored by an embedded actcache daemon, and read back from then on.
``--freeze-only`` adds a run that freezes without the cache, to show what
each part buys. The runs take turns every 5 steps, so a change in the
machine's load affects them alike. Every run uses one torch thread by
default, leaving the second core to the daemon and the client's put and
look-ahead threads: with two torch threads on two cores, that background
work preempts torch's thread pool and the cache stops paying (``--threads 2``
shows it).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable

import torch
from workloads.freezers import make_freezer
from workloads.tasks import digits
from workloads.trainer import RunResult, TrainingRun, Workload, interleave

import actcache_client as ac
from actcache_client.freeze.defaults import default_policy
from actcache_client.freeze.static import NoFreezePolicy

SLICE_STEPS = 5  # runs take turns every 5 steps
RUNS = {"full": ("full", False), "freeze+cache": ("static", True), "freeze only": ("static", False)}


class _PlainBar:
    """Progress as a line every tenth of the run, for when tqdm is not installed."""

    def __init__(self, desc: str, total: int, position: int) -> None:
        self.desc, self.total, self.n, self.start = desc, total, 0, time.perf_counter()

    def update(self, n: int, postfix: str) -> None:
        self.n += n
        if self.n == self.total or self.n % max(1, self.total // 10) == 0:
            filled = int(20 * self.n / self.total)
            print(f"{self.desc:<13}[{'#' * filled}{'.' * (20 - filled)}] {self.n}/{self.total} {postfix}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        """Nothing to release: every update printed a whole line."""


class _TqdmBar:
    def __init__(self, desc: str, total: int, position: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=f"{desc:<13}", unit="step", ncols=100, position=position, leave=True)

    def update(self, n: int, postfix: str) -> None:
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _bar(desc: str, total: int, position: int) -> _PlainBar | _TqdmBar:
    try:
        return _TqdmBar(desc, total, position)
    except ModuleNotFoundError:
        return _PlainBar(desc, total, position)


def _show_on(bar: _PlainBar | _TqdmBar) -> Callable[[int, int, float, ac.CachedForward], None]:
    def on_step(step: int, total: int, loss: float, model: ac.CachedForward) -> None:
        bar.update(1, f"loss {loss:.2f} frozen {model.frozen} cached {model.times.cached_samples}")

    return on_step


def run_demo(workload: Workload, connection: ac.Connection, runs: list[str], *, progress: bool = True,
             max_steps: int | None = None) -> dict[str, RunResult]:
    """Train ``workload`` once per named run (see RUNS), taking turns every few steps; cached runs use ``connection``.

    Taking turns (rather than one run after the other) makes the comparison
    fair on a machine whose load drifts: each run's clock only counts its own turns.
    """
    total = workload.epochs * -(-len(workload.train_set) // workload.batch_size)
    total = min(total, max_steps or total)
    bars, training = [], []
    for position, name in enumerate(runs):
        mode, cache = RUNS[name]
        freezer = make_freezer(mode, static_depth=workload.static_depth, static_at_epoch=workload.static_at_epoch)
        on_step = None
        if progress:
            bars.append(_bar(name, total, position))
            on_step = _show_on(bars[-1])
        training.append(TrainingRun(workload, freezer, connection if cache else None, max_steps=max_steps,
                                    on_step=on_step, slice_steps=SLICE_STEPS))
    try:
        results = interleave(training)
    finally:
        for bar in bars:
            bar.close()
    return dict(zip(runs, results))


def table(results: dict[str, RunResult]) -> str:
    base = results["full"].train_s
    lines = [f"{'run':<14}{'train time':>11}{'accuracy':>10}{'speedup':>9}{'hit ratio':>11}{'prefix from cache':>19}"]
    for name, r in results.items():
        c = r.cache_stats
        served = f"{c['cached_samples']}/{c['cached_samples'] + c['computed_samples']}" if r.cache else "-"
        hits = f"{c['hit_ratio']:.0%}" if r.cache else "-"
        lines.append(f"{name:<14}{r.train_s:>10.1f}s{r.final_metric:>9.1f}%{base / r.train_s:>8.2f}x{hits:>11}{served:>19}")
    return "\n".join(lines)


def why_hand_set(workload: Workload) -> str:
    """One line on why the demo freezes by hand rather than with FreezeController's default policy."""
    steps = math.ceil(len(workload.train_set) / workload.batch_size) * workload.epochs
    policy, _ = default_policy(steps, num_stages=11)
    if isinstance(policy, NoFreezePolicy):
        return f"FreezeController's default would not freeze here: {policy.reason.split(';')[0]}"
    return ("FreezeController's default did not pay on digits (40 epochs: 0.97x time to accuracy, "
            "docs/guides/freeze-policies.md); a hand-set freeze does")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--freeze-only", action="store_true", help="also run with freezing but without the cache")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of every run (default 1: the other core serves the cache's I/O)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = digits(epochs=args.epochs)
    runs = ["full", "freeze+cache"] + (["freeze only"] if args.freeze_only else [])
    print(f"ResNet-20 on scikit-learn's handwritten digits (8x8 upsampled to 32x32): {len(workload.train_set)} train / "
          f"{len(workload.eval_set)} test images, {workload.epochs} epochs, batch {workload.batch_size}, "
          f"{torch.get_num_threads()} torch thread(s)")
    print(f"freeze+cache: stages 0..{workload.static_depth - 1} of 11 (stem, layer1, layer2) freeze at epoch "
          f"{workload.static_at_epoch:g}; the daemon serves their output from then on")
    print(f"why by hand: {why_hand_set(workload)}")
    with ac.connect(namespace="demo", embedded=True) as conn:  # a private daemon in a temp dir, stopped at the end
        print(f"actcache daemon: {conn.target}")
        results = run_demo(workload, conn, runs)
    print()
    print(table(results))
    cached = results["freeze+cache"]
    print(f"\nfreeze+cache wrote {cached.cache_stats['bytes_written'] / 1e6:.0f} MB of activations and read "
          f"{cached.cache_stats['bytes_read'] / 1e6:.0f} MB back; accuracy is on the {len(workload.eval_set)} held-out "
          "images; times are training only (evaluation excluded) and vary with other jobs on the machine.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
