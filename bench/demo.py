"""The actcache demo: one small training run twice, every stage training vs the front frozen and served from the cache.

    make demo        (or: python bench/demo.py [--epochs 10] [--freeze-only])

ResNet-20 learns scikit-learn's 1,797 handwritten 8x8 digits (shipped with
the package: nothing is downloaded), upsampled to 32x32. The second run
freezes the stem and the first two residual layers (about 2/3 of the
forward compute) after 30% of the epochs; their outputs are computed once
more, stored by an embedded actcache daemon, and read back from then on.
``--freeze-only`` adds a run that freezes without the cache, to show what
each part buys.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch

import actcache_client as ac
from workloads.freezers import make_freezer
from workloads.tasks import digits
from workloads.trainer import RunResult, Workload, train

RUNS = {"full": ("full", False), "freeze+cache": ("static", True), "freeze only": ("static", False)}


class _PlainBar:
    """A one-line progress bar for when tqdm is not installed."""

    def __init__(self, desc: str, total: int) -> None:
        self.desc, self.total, self.n, self.start = desc, total, 0, time.perf_counter()

    def update(self, n: int, postfix: str) -> None:
        self.n += n
        filled = int(30 * self.n / self.total)
        print(f"\r{self.desc:<13}[{'#' * filled}{'.' * (30 - filled)}] {self.n}/{self.total} "
              f"{time.perf_counter() - self.start:5.1f}s {postfix}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


class _TqdmBar:
    def __init__(self, desc: str, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=f"{desc:<13}", unit="step", ncols=100, leave=True)

    def update(self, n: int, postfix: str) -> None:
        self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _bar(desc: str, total: int) -> _PlainBar | _TqdmBar:
    try:
        return _TqdmBar(desc, total)
    except ModuleNotFoundError:
        return _PlainBar(desc, total)


def run_demo(workload: Workload, connection: ac.Connection, runs: list[str], *, progress: bool = True,
             max_steps: int | None = None) -> dict[str, RunResult]:
    """Train ``workload`` once per named run (see RUNS); cached runs use ``connection``, each its own entries."""
    results = {}
    for name in runs:
        mode, cache = RUNS[name]
        freezer = make_freezer(mode, static_depth=workload.static_depth, static_at_epoch=workload.static_at_epoch)
        bar = None
        on_step: Callable | None = None
        if progress:
            total = workload.epochs * -(-len(workload.train_set) // workload.batch_size)
            bar = _bar(name, min(total, max_steps or total))

            def on_step(step: int, total: int, loss: float, model: ac.CachedForward) -> None:
                t = model.times
                bar.update(1, f"loss {loss:.2f} frozen {model.frozen} cached {t.cached_samples}")

        try:
            results[name] = train(workload, freezer, connection if cache else None, max_steps=max_steps,
                                  on_step=on_step)
        finally:
            if bar is not None:
                bar.close()
    return results


def table(results: dict[str, RunResult]) -> str:
    base = results["full"].train_s
    lines = [f"{'run':<14}{'train time':>11}{'accuracy':>10}{'speedup':>9}{'hit ratio':>11}{'prefix from cache':>19}"]
    for name, r in results.items():
        c = r.cache_stats
        served = f"{c['cached_samples']}/{c['cached_samples'] + c['computed_samples']}" if r.cache else "-"
        hits = f"{c['hit_ratio']:.0%}" if r.cache else "-"
        lines.append(f"{name:<14}{r.train_s:>10.1f}s{r.final_metric:>9.1f}%{base / r.train_s:>8.2f}x{hits:>11}{served:>19}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--freeze-only", action="store_true", help="also run with freezing but without the cache")
    args = parser.parse_args()
    workload = digits(epochs=args.epochs)
    runs = ["full", "freeze+cache"] + (["freeze only"] if args.freeze_only else [])
    print(f"ResNet-20 on scikit-learn's handwritten digits (8x8 upsampled to 32x32): {len(workload.train_set)} train / "
          f"{len(workload.eval_set)} test images, {workload.epochs} epochs, batch {workload.batch_size}, "
          f"{torch.get_num_threads()} threads")
    print(f"freeze+cache: stages 0..{workload.static_depth - 1} of 11 (stem, layer1, layer2) freeze at epoch "
          f"{workload.static_at_epoch:g}; the daemon serves their output from then on")
    with ac.connect(namespace="demo") as conn:  # no socket given: an embedded daemon in a temp dir
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
