"""Training steps/s of ResNet-20 with its first half frozen: prefix recomputed vs served from the cache, with and without audits.

    python bench/bench_step.py [--quick] [--samples 4096] [--batch 128] [--frozen 5]

Both modes run in the same process on the same data against one real daemon
(Unix socket, LMDB in a temp dir). The cache is filled by one epoch first;
then the modes take turns, epoch by epoch, and we report steps/s, samples/s
and the time split per step. ``cached`` audits hits as CachedForward does by
default (the first 8 hits of each run, then 1 in 1,000); ``cached-noaudit``
serves them unchecked. Sample output (2 cores, --quick):

    mode              steps/s  samples/s  fetch_wait  prefix  suffix_fwd  backward  optimizer  audit   (ms/step)
    recompute            ...
    cached               ...
    cached-noaudit       ...
    figure: cached_step_speedup = R
    figure: audit_overhead = R
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import actcache_client as ac
from actcache.testing import run_daemon
from actcache_client.models import resnet20


def run_epochs(model: ac.CachedForward, loader: ac.CachedLoader, epochs: int) -> dict[str, float]:
    opt = torch.optim.SGD([p for p in model.model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    model.times = ac.StepTimes()  # per call: each turn reports its own split
    backward = optimizer = 0.0
    steps = samples = 0
    start = time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            x, y = batch.data
            loss = nn.functional.cross_entropy(model(batch.ids, x), y)
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            optimizer += time.perf_counter() - t1
            backward += t1 - t0
            steps += 1
            samples += len(batch.ids)
    wall = time.perf_counter() - start
    t = model.times
    return {
        "steps_per_s": steps / wall, "samples_per_s": samples / wall, "wall_s": wall,
        "fetch_wait_ms": 1e3 * t.fetch_wait / steps, "prefix_ms": 1e3 * t.prefix / steps,
        "suffix_forward_ms": 1e3 * t.suffix_forward / steps, "backward_ms": 1e3 * backward / steps,
        "optimizer_ms": 1e3 * optimizer / steps, "audit_ms": 1e3 * t.audit / steps, "cached_samples": t.cached_samples,
        "computed_samples": t.computed_samples,
    }


def _combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """Totals over epochs: rates from summed wall time, per-step times averaged."""
    wall = sum(p["wall_s"] for p in parts)
    out = {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}
    out.update(wall_s=wall, steps_per_s=sum(p["steps_per_s"] * p["wall_s"] for p in parts) / wall,
               samples_per_s=sum(p["samples_per_s"] * p["wall_s"] for p in parts) / wall,
               cached_samples=sum(p["cached_samples"] for p in parts),
               computed_samples=sum(p["computed_samples"] for p in parts))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--frozen", type=int, default=5, help="stages frozen (ResNet-20 has 11: stem, 9 blocks, head)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.epochs = 1024, 2
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 3, 32, 32), torch.randint(0, 10, (args.samples,)))
    staged = ac.from_resnet(resnet20())
    with run_daemon() as daemon, ac.connect(daemon.socket, namespace="bench-step", strict=True) as conn:
        # One CachedForward per mode over the same stages; each keeps its own auditor across its turns.
        models = {"recompute": ac.CachedForward(staged), "cached": ac.CachedForward(staged, conn),
                  "cached-noaudit": ac.CachedForward(staged, conn, audit=False)}
        loaders = {mode: ac.CachedLoader(DataLoader(ac.IndexedDataset(data), batch_size=args.batch, shuffle=True), m)
                   for mode, m in models.items()}
        for m in models.values():
            m.set_frozen(args.frozen)
        run_epochs(models["cached"], loaders["cached"], 1)  # fills the cache (and warms up)
        conn.flush()
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in models}
        for _ in range(args.epochs):  # the modes take turns so machine drift hits them alike
            for mode in runs:
                runs[mode].append(run_epochs(models[mode], loaders[mode], 1))
        rows = {mode: _combine(parts) for mode, parts in runs.items()}
        hit_ratio = conn.stats.hit_ratio
    print(f"ResNet-20, {args.frozen}/{staged.num_stages} stages frozen, batch {args.batch}, "
          f"{args.samples} samples x {args.epochs} epochs, {torch.get_num_threads()} threads")
    cols = ["fetch_wait_ms", "prefix_ms", "suffix_forward_ms", "backward_ms", "optimizer_ms", "audit_ms"]
    print(f"{'mode':<16}{'steps/s':>8}{'samples/s':>11}" + "".join(f"{c[:-3]:>16}" for c in cols) + "   (ms/step)")
    for mode, r in rows.items():
        print(f"{mode:<16}{r['steps_per_s']:>8.2f}{r['samples_per_s']:>11.0f}" + "".join(f"{r[c]:>16.1f}" for c in cols))
    speedup = rows["cached"]["steps_per_s"] / rows["recompute"]["steps_per_s"]
    audit_overhead = rows["cached-noaudit"]["steps_per_s"] / rows["cached"]["steps_per_s"]
    print(f"cache hit ratio {hit_ratio:.1%} (fill epoch included); cached mode served "
          f"{rows['cached']['cached_samples']} samples, computed {rows['cached']['computed_samples']}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "speedup": speedup, "audit_overhead": audit_overhead}, indent=2))
    print(f"audits took {rows['cached']['audit_ms']:.2f} ms of {1e3 / rows['cached']['steps_per_s']:.1f} ms per cached step")
    print(f"figure: cached_step_speedup = {speedup:.2f}")
    print(f"figure: audit_overhead = {audit_overhead:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
