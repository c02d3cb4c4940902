"""Several nodes on one machine: cache hits and per-node storage with the NodeStableSampler vs a DistributedSampler,
and what node-local shuffling costs in accuracy.

    python bench/bench_nodes.py [--quick] [--nodes 4] [--ranks 2] [--samples 2048] [--epochs 8]
                                [--seeds 20] [--train-epochs 8] [--json PATH]

Part 1, the cache: ``--nodes`` simulated nodes, each with its own daemon
(``actcache.testing.run_daemon``: own socket, own LMDB directory), ``--ranks``
ranks per node, each rank a CachedLoader + CachedForward of ResNet-20 with
the stem and layer1 frozen (64 KiB entries) reading its node's daemon. The
ranks run in one process, one after the other within an epoch (the
samplers decide what each rank sees; no gradients are exchanged, the
prefix is all that is measured). At each epoch's end every rank flushes its
puts, as a barrier would in DDP. The same run is made with the
NodeStableSampler and with a plain DistributedSampler (seeded shuffle over
all ranks). Random inputs: hits do not depend on what the images show.

Part 2, the statistics: an MLP with BatchNorm on scikit-learn's digits
(1,437 train / 360 test), data parallel simulated exactly as DDP computes
it (each rank's batch through the model with its own BatchNorm statistics,
rank 0's running statistics kept, gradients averaged over ranks), global
vs node-stable shuffling at 2 and 4 nodes of ``--ranks`` ranks, the same
seeds for both. A third row trains on the data sorted by class with
``block_size`` = one tenth of it (each block a single class, 10 canonical
nodes): the case where node-local shuffling hurts.

Figures (2 cores, shared machine): docs/benchmarks.md.
The last lines:

    figure: node_hit_ratio = R               (epochs >= 2, worst rank, node-stable sampler)
    figure: global_shuffle_hit_ratio = R     (epochs >= 2, all ranks, DistributedSampler, same run)
    figure: node_stable_metric_delta = D     (accuracy points, node-stable - global, mean over 2/4 nodes and seeds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from capacity import expected_global_hit_ratio  # noqa: E402

import actcache_client as ac  # noqa: E402
from actcache.testing import run_daemon  # noqa: E402
from actcache_client.models import resnet20  # noqa: E402

FROZEN = 4  # ResNet-20: stem + layer1 (16x32x32 fp32 per sample)


# ---- part 1: the cache ---------------------------------------------------------------------------------------


def _sampler(kind: str, n: int, nodes: int, ranks: int, node: int, local: int, seed: int) -> Sampler[int]:
    if kind == "node-stable":
        return ac.NodeStableSampler(n, num_nodes=nodes, node_rank=node, local_world_size=ranks, local_rank=local,
                                    seed=seed)
    return DistributedSampler(range(n), num_replicas=nodes * ranks, rank=node * ranks + local, shuffle=True, seed=seed)


def cache_run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Hits per rank and epoch, and entries per daemon, with one sampler kind."""
    g = torch.Generator().manual_seed(0)
    data = ac.IndexedDataset(TensorDataset(torch.randn(args.samples, 3, 32, 32, generator=g),
                                           torch.zeros(args.samples, dtype=torch.int64)))
    namespace = f"nodes-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        daemons = [stack.enter_context(run_daemon()) for _ in range(args.nodes)]
        ranks = []
        for node in range(args.nodes):
            for local in range(args.ranks):
                conn = stack.enter_context(ac.connect(daemons[node].socket, namespace=namespace, strict=True))
                torch.manual_seed(0)  # every rank holds the same weights, as under DDP
                model = ac.CachedForward(ac.from_resnet(resnet20().eval()), conn)
                sampler = _sampler(kind, args.samples, args.nodes, args.ranks, node, local, seed=1)
                loader = ac.CachedLoader(DataLoader(data, batch_size=args.batch, sampler=sampler), model)
                model.set_frozen(FROZEN)
                ranks.append({"node": node, "model": model, "loader": loader, "conn": conn, "epochs": []})
        t0 = time.perf_counter()
        for epoch in range(args.epochs):
            for r in ranks:
                model, before = r["model"], (r["model"].times.cached_samples, r["model"].times.prefix_samples)
                r["loader"].set_epoch(epoch)
                with torch.no_grad():
                    for batch in r["loader"]:
                        model.prefix(batch)
                r["epochs"].append((model.times.cached_samples - before[0], model.times.prefix_samples - before[1]))
            for r in ranks:  # what a barrier at the epoch's end gives under DDP
                r["conn"].flush()
        seconds = time.perf_counter() - t0
        entries, stored = [], []
        for d in daemons:
            with d.client() as client:
                ns = [s for s in client.stats().namespaces if s.name == namespace]
                entries.append(ns[0].entries if ns else 0)
                stored.append(ns[0].bytes if ns else 0)
    later = [(sum(c for c, _ in r["epochs"][1:]), sum(p for _, p in r["epochs"][1:])) for r in ranks]
    per_epoch = [sum(r["epochs"][e][0] for r in ranks) / sum(r["epochs"][e][1] for r in ranks)
                 for e in range(args.epochs)]
    return {
        "sampler": kind, "seconds": seconds, "entries_per_node": entries, "bytes_per_node": stored,
        "hit_ratio_per_epoch": per_epoch,
        "worst_rank_hit_ratio": min(c / p for c, p in later),
        "hit_ratio": sum(c for c, _ in later) / sum(p for _, p in later),
    }


# ---- part 2: the statistics ----------------------------------------------------------------------------------


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    mean, std = x[train].mean(0), x[train].std(0) + 1e-3
    return (x[train] - mean) / std, y[train], (x[test] - mean) / std, y[test]


def train_run(kind: str, nodes: int, ranks: int, seed: int, epochs: int, batch: int,
              data: tuple[torch.Tensor, ...], *, sorted_blocks: bool = False) -> float:
    """Test accuracy (%) after data-parallel training as DDP computes it, simulated in one process."""
    x, y, x_test, y_test = data
    if sorted_blocks:  # the data stored sorted by class, kept together in blocks of a tenth of it
        by_class = torch.argsort(y, stable=True)
        x, y = x[by_class], y[by_class]
    n, world = len(y), nodes * ranks
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32), nn.BatchNorm1d(32),
                          nn.ReLU(), nn.Linear(32, 10))
    norms = [m for m in model if isinstance(m, nn.BatchNorm1d)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "node-stable":
        block = -(-n // 10) if sorted_blocks else 1
        samplers = [ac.NodeStableSampler(n, num_nodes=nodes, node_rank=r // ranks, local_world_size=ranks,
                                         local_rank=r % ranks, seed=seed, block_size=block) for r in range(world)]
    else:
        samplers = [DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=seed)
                    for r in range(world)]
    for epoch in range(epochs):
        model.train()
        orders = []
        for s in samplers:
            s.set_epoch(epoch)
            orders.append(torch.tensor(list(s)))
        for start in range(0, len(orders[0]), batch):
            opt.zero_grad()
            for r, order in enumerate(orders):
                idx = order[start:start + batch]
                for m in norms:  # DDP keeps rank 0's running statistics (broadcast_buffers)
                    m.momentum = 0.1 if r == 0 else 0.0
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx]) / world
                loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        return 100.0 * float((model(x_test).argmax(1) == y_test).float().mean())


def statistics_runs(args: argparse.Namespace) -> dict[str, Any]:
    data = digits()
    rows = []
    for nodes in (2, 4):
        accs: dict[str, list[float]] = {"global": [], "node-stable": [], "node-stable, class-sorted blocks": []}
        for seed in range(args.seeds):
            sizes = (args.ranks, seed, args.train_epochs, args.train_batch, data)
            accs["global"].append(train_run("global", nodes, *sizes))
            accs["node-stable"].append(train_run("node-stable", nodes, *sizes))
            accs["node-stable, class-sorted blocks"].append(train_run("node-stable", nodes, *sizes, sorted_blocks=True))
        for name, values in accs.items():
            deltas = [a - b for a, b in zip(values, accs["global"])]
            rows.append({"nodes": nodes, "shuffle": name, "accuracy": values, "mean": statistics.fmean(values),
                         "delta_vs_global": deltas})
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes: a few minutes on 2 cores")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="ranks per node")
    p.add_argument("--samples", type=int, default=None, help="part 1 samples (default 2048, --quick 1024)")
    p.add_argument("--epochs", type=int, default=None, help="part 1 epochs (default 8, --quick 5)")
    p.add_argument("--batch", type=int, default=32, help="part 1 batch per rank")
    p.add_argument("--seeds", type=int, default=None, help="part 2 seeds (default 20, --quick 10)")
    p.add_argument("--train-epochs", type=int, default=8, help="part 2 epochs")
    p.add_argument("--train-batch", type=int, default=8, help="part 2 batch per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "bench_nodes.json")
    args = p.parse_args(argv)
    args.samples = args.samples or (1024 if args.quick else 2048)
    args.epochs = args.epochs or (5 if args.quick else 8)
    args.seeds = args.seeds or (10 if args.quick else 20)
    torch.set_num_threads(args.threads)

    print(f"part 1: {args.nodes} nodes x {args.ranks} ranks, one daemon per node, ResNet-20 frozen {FROZEN}/11, "
          f"{args.samples} samples x {args.epochs} epochs, batch {args.batch} per rank")
    width = max(32, 6 * args.epochs)
    print(f"{'sampler':12s}  {'hit ratio per epoch':{width}s}  {'worst rank e>=2':>15s}  {'entries per node':>28s}  "
          f"{'MiB per node':>12s}  {'s':>5s}")
    cache = {}
    for kind in ("node-stable", "global"):
        r = cache[kind] = cache_run(kind, args)
        print(f"{kind:12s}  {' '.join(f'{h:.3f}' for h in r['hit_ratio_per_epoch']):{width}s}  "
              f"{r['worst_rank_hit_ratio']:15.3f}  {' '.join(map(str, r['entries_per_node'])):>28s}  "
              f"{statistics.fmean(r['bytes_per_node']) / 2**20:12.1f}  {r['seconds']:5.1f}")
    model = [expected_global_hit_ratio(args.nodes, e) for e in range(1, args.epochs + 1)]
    print(f"{'global model':12s}  {' '.join(f'{h:.3f}' for h in model):{width}s}  (1 - (1 - 1/nodes)^(epoch - 1), "
          "bench/capacity.py)")

    print(f"\npart 2: MLP+BatchNorm on digits, {args.ranks} ranks per node, batch {args.train_batch} per rank, "
          f"{args.train_epochs} epochs, seeds 0..{args.seeds - 1}; test accuracy %")
    print(f"{'nodes':>5s}  {'shuffle':34s}  {'mean':>6s}  {'min':>6s}  {'max':>6s}  {'delta vs global (pts)':>22s}")
    stats = statistics_runs(args)
    for row in stats["rows"]:
        d = row["delta_vs_global"]
        spread = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0
        print(f"{row['nodes']:5d}  {row['shuffle']:34s}  {row['mean']:6.2f}  {min(row['accuracy']):6.2f}  "
              f"{max(row['accuracy']):6.2f}  {statistics.fmean(d):+10.2f} +- {spread:.2f} (s.e.)")
    delta = statistics.fmean(d for row in stats["rows"] if row["shuffle"] == "node-stable"
                             for d in row["delta_vs_global"])

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cache": cache,
                                     "statistics": stats}, indent=1))
    print(f"\nresults: {args.json}")
    print(f"figure: node_hit_ratio = {cache['node-stable']['worst_rank_hit_ratio']:.4f}")
    print(f"figure: global_shuffle_hit_ratio = {cache['global']['hit_ratio']:.4f}")
    print(f"figure: node_stable_metric_delta = {delta:+.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
