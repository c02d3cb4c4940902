"""Epoch times of always-cache, never-cache and the cost model, on a normal and a throttled daemon.

    python bench/bench_costmodel.py [--quick] [--samples 2048] [--epochs 3] [--throttle-mbps 5]

ResNet-20 with 5 of its 11 stages frozen trains ``--epochs`` epochs per
strategy (the first epoch writes the cache); each strategy starts from an
empty namespace, so the write epoch is part of its time. The throttled
daemon (``actcache serve --throttle-read-mbps``) reproduces a slow disk.
Everything runs in one process, strategies interleaved per daemon. Sample
output (2 cores, --quick):

    daemon       strategy     epoch times (s)      total (s)  hits   plan
    normal       always       ...
    figure: costmodel_vs_best = R
"""

from __future__ import annotations

import argparse
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


def run(strategy: str, socket: str, data: TensorDataset, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    staged = ac.from_resnet(resnet20())
    planner = ac.CachePlanner(ac.PlannerConfig(total_epochs=args.epochs)) if strategy == "costmodel" else None
    with ac.connect(socket, namespace=f"bench-{uuid.uuid4().hex[:8]}") as conn:
        model = ac.CachedForward(staged, conn if strategy != "never" else None, planner=planner)
        loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(data), batch_size=args.batch, shuffle=True), model)
        opt = torch.optim.SGD(staged.parameters(), lr=0.01, momentum=0.9)
        model.set_frozen(FROZEN)
        epochs = []
        for _ in range(args.epochs):
            t0 = time.perf_counter()
            for batch in loader:
                x, y = batch.data
                loss = nn.functional.cross_entropy(model(batch.ids, x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            epochs.append(time.perf_counter() - t0)
        conn.flush(timeout_s=120)
        plan = model.plan
        return {"epochs_s": epochs, "total_s": sum(epochs), "hits": conn.stats.hits,
                "plan": plan.mode.value if plan else "-", "reason": plan.reason if plan else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--throttle-mbps", type=float, default=5.0,
                        help="served MB/s of the throttled daemon (default 5: below what a cached step consumes)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.samples = 512
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 3, 32, 32), torch.randint(0, 10, (args.samples,)))
    results: dict[str, dict[str, dict]] = {}
    print(f"ResNet-20, {FROZEN} of 11 stages frozen, {args.samples} samples, batch {args.batch}, {args.epochs} epochs")
    print(f"{'daemon':<12}{'strategy':<12}{'epoch times (s)':<24}{'total (s)':>10}{'hits':>8}   plan")
    for label, flags in (("normal", []), (f"{args.throttle_mbps:g}MB/s", ["--throttle-read-mbps", str(args.throttle_mbps)])):
        with run_daemon(*flags) as daemon:
            results[label] = {s: run(s, str(daemon.socket), data, args) for s in ("always", "never", "costmodel")}
        for strategy, r in results[label].items():
            epochs = " ".join(f"{t:.2f}" for t in r["epochs_s"])
            print(f"{label:<12}{strategy:<12}{epochs:<24}{r['total_s']:>10.2f}{r['hits']:>8}   {r['plan']}")
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
