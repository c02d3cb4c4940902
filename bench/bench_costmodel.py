"""Epoch times of always-cache, never-cache and the cost model, on a normal and a throttled daemon.

    python bench/bench_costmodel.py [--quick] [--samples 2048] [--epochs 3] [--throttle-mbps 5]

ResNet-20 with 5 of its 11 stages frozen trains ``--epochs`` epochs per
strategy (the first epoch writes the cache); each strategy starts from an
empty namespace, so the write epoch is part of its time. The throttled
daemon (``actcache serve --throttle-read-mbps``) reproduces a slow disk.
Everything runs in one process; against each daemon the three strategies
take turns epoch by epoch, so a drift in the machine's load hits them
alike. "cached" counts the samples whose frozen prefix came from the cache.
Sample output (2 cores, --quick):

    daemon       strategy     epoch times (s)      total (s)  cached   plan
    normal       always       ...
    figure: costmodel_vs_best = R
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import uuid
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import actcache_client as ac
from actcache.testing import run_daemon
from actcache_client.models import resnet20

FROZEN = 5
STRATEGIES = ("always", "never", "costmodel")


class StrategyRun:
    """One strategy's training, advanced an epoch at a time so that strategies can take turns."""

    def __init__(self, strategy: str, conn, data: TensorDataset, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.strategy, self.conn = strategy, conn
        self.staged = ac.from_resnet(resnet20())
        planner = ac.CachePlanner(ac.PlannerConfig(total_epochs=args.epochs)) if strategy == "costmodel" else None
        self.model = ac.CachedForward(self.staged, conn if strategy != "never" else None, planner=planner)
        self.loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(data), batch_size=args.batch, shuffle=True),
                                      self.model)
        self.opt = torch.optim.SGD(self.staged.parameters(), lr=0.01, momentum=0.9)
        self.model.set_frozen(FROZEN)
        self.epochs: list[float] = []

    def epoch(self) -> None:
        t0 = time.perf_counter()
        for batch in self.loader:
            x, y = batch.data
            loss = nn.functional.cross_entropy(self.model(batch.ids, x), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        self.epochs.append(time.perf_counter() - t0)

    def result(self) -> dict:
        self.conn.flush(timeout_s=120)
        plan = self.model.plan
        return {"epochs_s": self.epochs, "total_s": sum(self.epochs), "cached_samples": self.model.times.cached_samples,
                "plan": plan.mode.value if plan else "-", "reason": plan.reason if plan else ""}


def run_strategies(socket: str, data: TensorDataset, args: argparse.Namespace) -> dict[str, dict]:
    """Every strategy against one daemon, taking turns epoch by epoch (load drifts hit them alike)."""
    with contextlib.ExitStack() as stack:
        runs = [StrategyRun(s, stack.enter_context(ac.connect(socket, namespace=f"bench-{uuid.uuid4().hex[:8]}")),
                            data, args) for s in STRATEGIES]
        for _ in range(args.epochs):
            for r in runs:
                r.epoch()
        return {r.strategy: r.result() for r in runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--throttle-mbps", type=float, default=5.0,
                        help="served MB/s of the throttled daemon (default 5: below what a cached step consumes)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a small machine a second one fights the cache's "
                             "background threads and the daemon for the cores)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.samples = 512
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 3, 32, 32), torch.randint(0, 10, (args.samples,)))
    results: dict[str, dict[str, dict]] = {}
    print(f"ResNet-20, {FROZEN} of 11 stages frozen, {args.samples} samples, batch {args.batch}, {args.epochs} epochs")
    print(f"{'daemon':<12}{'strategy':<12}{'epoch times (s)':<24}{'total (s)':>10}{'cached':>8}   plan")
    for label, flags in (("normal", []), (f"{args.throttle_mbps:g}MB/s", ["--throttle-read-mbps", str(args.throttle_mbps)])):
        with run_daemon(*flags) as daemon:
            results[label] = run_strategies(str(daemon.socket), data, args)
        for strategy, r in results[label].items():
            epochs = " ".join(f"{t:.2f}" for t in r["epochs_s"])
            print(f"{label:<12}{strategy:<12}{epochs:<24}{r['total_s']:>10.2f}{r['cached_samples']:>8}   {r['plan']}")
        print(f"{'':<12}cost model's last plan: {results[label]['costmodel']['reason']}")
    ratios = {}
    for label, r in results.items():
        best = min(r["always"]["total_s"], r["never"]["total_s"])
        ratios[label] = r["costmodel"]["total_s"] / best
        print(f"{label:<12}cost model / best fixed choice = {ratios[label]:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "ratios": ratios}, indent=2))
    print(f"figure: costmodel_vs_best = {max(ratios.values()):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
