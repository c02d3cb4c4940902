"""Training step time of ResNet-20 on CIFAR-10 JPEGs with a frozen prefix: recomputed, served by the daemon, and the ideal.

    python bench/bench_step.py [--quick] [--samples 2048] [--batch 128] [--frozen 5 10] [--threads 1] [--device cuda]

Per frozen depth, four modes take turns epoch by epoch in one process on the
same data (the JPEGs are decoded on every load, as a loader over image files
does), against one real daemon (Unix socket, LMDB in a temp dir):

- ``recompute``: the frozen prefix runs every step on every decoded image;
- ``cached``: CachedLoader + CachedForward as a user runs them — the order is
  pushed, the step reads the daemon's stream (shared memory), stored inputs
  are not loaded, hits are audited (default AuditConfig);
- ``cached-noaudit``: the same without audits;
- ``ideal``: the prefix outputs held in a dict in process memory, stacked per
  batch, no daemon and no loading: the limit a cache can reach. On CUDA the
  stacked batch goes to the GPU the way served entries do (a pinned slot, a
  side-stream copy).

One fill epoch stores the entries first, and one untimed epoch per cached mode
follows it: the timed epochs are the steady state, where each epoch's order
was pushed halfway through the one before (the first epoch after a fill
pushes its own at its start, a one-time cost of a few ms a run). Sample
output (2 cores, --quick):

    ResNet-20, frozen 5/11, batch 128, 2048 samples x 2 epochs, 1 torch thread
    mode              ms/step  load  fetch_wait  prefix  suffix_fwd  backward  optimizer  audit   (ms/step)
    ...
    figure: cached_vs_ideal = R            (frozen 5: cached / ideal step time)
    figure: cached_vs_ideal_fast = R       (frozen 10)
    figure: train_prefetch_hit_ratio = R   (entries ready when the step asked, timed epochs)
    figure: raw_items_loaded_share = R     (raw items loaded / samples, timed cached epochs)
    figure: cached_step_speedup = R        (frozen 5: recompute / cached step time)
    figure: audit_overhead = R             (frozen 5: cached / cached-noaudit step time)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads.data import JpegSet, resolve_data_dir  # noqa: E402

import actcache_client as ac  # noqa: E402
from actcache.testing import run_daemon  # noqa: E402
from actcache_client.models import resnet20  # noqa: E402
from actcache_client.transport._device_staging import Stager

COLUMNS = ["load_ms", "fetch_wait_ms", "prefix_ms", "suffix_forward_ms", "backward_ms", "optimizer_ms", "audit_ms"]


def _step(model_out: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer, clock: dict[str, float]) -> None:
    loss = nn.functional.cross_entropy(model_out, y)
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    clock["optimizer"] += time.perf_counter() - t1
    clock["backward"] += t1 - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_epoch(model: ac.CachedForward, loader: ac.CachedLoader, opt, device: torch.device) -> dict[str, float]:
    """One epoch through CachedLoader + CachedForward; per-step times (on CUDA the parts are launch times)."""
    model.times = ac.StepTimes()
    clock = {"backward": 0.0, "optimizer": 0.0, "load": 0.0}
    steps = samples = 0
    start = time.perf_counter()
    batches = iter(loader)
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        clock["load"] += time.perf_counter() - t0
        if batch is None:
            break
        _step(model(batch), batch.data[1].to(device, non_blocking=True), opt, clock)
        steps += 1
        samples += len(batch.ids)
    _sync(device)
    wall = time.perf_counter() - start
    t = model.times
    return {
        "step_ms": 1e3 * wall / steps, "load_ms": 1e3 * clock["load"] / steps, "fetch_wait_ms": 1e3 * t.fetch_wait / steps,
        "prefix_ms": 1e3 * t.prefix / steps, "suffix_forward_ms": 1e3 * t.suffix_forward / steps,
        "backward_ms": 1e3 * clock["backward"] / steps, "optimizer_ms": 1e3 * clock["optimizer"] / steps,
        "audit_ms": 1e3 * t.audit / steps, "samples": samples, "raw_loaded": t.raw_loaded,
        "cached_samples": t.cached_samples,
    }


def ideal_epoch(staged: ac.StagedModel, frozen: int, memory: dict[int, torch.Tensor], labels: torch.Tensor,
                sampler: RandomSampler, batch_size: int, opt, stager: Stager) -> dict[str, float]:
    """One epoch whose prefix outputs come from a dict in memory, stacked per batch: no daemon, no loading."""
    clock = {"backward": 0.0, "optimizer": 0.0}
    order = list(sampler)
    steps = 0
    load = suffix = 0.0
    start = time.perf_counter()
    for lo in range(0, len(order), batch_size):
        ids = order[lo : lo + batch_size]
        t0 = time.perf_counter()
        rows = [memory[i] for i in ids]
        state = stager.to_device(torch.stack(rows, out=stager.allocator()((len(rows), *rows[0].shape), rows[0].dtype)))
        y = labels[ids].to(stager.device, non_blocking=True)
        t1 = time.perf_counter()
        out = staged.run(state, frozen)
        suffix += time.perf_counter() - t1
        load += t1 - t0
        _step(out, y, opt, clock)
        steps += 1
    _sync(stager.device)
    wall = time.perf_counter() - start
    return {"step_ms": 1e3 * wall / steps, "load_ms": 1e3 * load / steps, "fetch_wait_ms": 0.0, "prefix_ms": 0.0,
            "suffix_forward_ms": 1e3 * suffix / steps, "backward_ms": 1e3 * clock["backward"] / steps,
            "optimizer_ms": 1e3 * clock["optimizer"] / steps, "audit_ms": 0.0, "samples": len(order),
            "raw_loaded": 0, "cached_samples": len(order)}


def _combine(parts: list[dict[str, float]]) -> dict[str, float]:
    out = {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}
    for k in ("samples", "raw_loaded", "cached_samples"):
        out[k] = sum(p[k] for p in parts)
    return out


def _ready_and_asked(conn: ac.Connection) -> tuple[int, int]:
    """The daemon's counters for this namespace: entries ready when asked, entries asked."""
    for p in conn.rpc().stats().prefetch:
        if p.namespace == conn.config.namespace:
            return p.counters.ready_on_ask, p.counters.hits + p.counters.misses
    return 0, 0


def run_depth(daemon, dataset: JpegSet, frozen: int, args) -> tuple[dict[str, dict[str, float]], float]:
    """The four modes at one frozen depth; returns their rows and the prefetch hit ratio of the timed epochs."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    staged = ac.from_resnet(resnet20()).to(device)
    with ac.connect(daemon.socket, namespace=f"bench-step-{frozen}", strict=True) as conn:
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(args.store_dtype)
        models = {"recompute": ac.CachedForward(staged), "cached": ac.CachedForward(staged, conn, store_dtype=dtype),
                  "cached-noaudit": ac.CachedForward(staged, conn, audit=False, store_dtype=dtype)}
        loaders = {mode: ac.CachedLoader(DataLoader(ac.IndexedDataset(dataset, targets=dataset.labels),
                                                    batch_size=args.batch, shuffle=True,
                                                    pin_memory=device.type == "cuda",
                                                    generator=torch.Generator().manual_seed(i)), m)
                   for i, (mode, m) in enumerate(models.items())}
        for m in models.values():
            m.set_frozen(frozen)
        opt = torch.optim.SGD([p for p in staged.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
        cached_epoch(models["cached"], loaders["cached"], opt, device)  # fills the cache
        conn.flush()
        for mode in ("cached", "cached-noaudit"):  # the first epoch on a filled cache pushes its order at its start
            cached_epoch(models[mode], loaders[mode], opt, device)  # (the fill stored misses); later ones halfway
        with torch.no_grad():
            memory = {}
            for lo in range(0, len(dataset), args.batch):
                ids = list(range(lo, min(lo + args.batch, len(dataset))))
                out = staged.run(torch.stack([dataset[i][0] for i in ids]).to(device), 0, frozen)
                memory.update(zip(ids, out.cpu().clone().unbind(0)))
        stager = Stager(device)
        sampler = RandomSampler(range(len(dataset)), generator=torch.Generator().manual_seed(9))
        ready0, asked0 = _ready_and_asked(conn)
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in [*models, "ideal"]}
        for _ in range(args.epochs):  # the modes take turns so machine drift hits them alike
            for mode in runs:
                if mode == "ideal":
                    runs[mode].append(ideal_epoch(staged, frozen, memory, dataset.labels, sampler, args.batch, opt,
                                                  stager))
                else:
                    runs[mode].append(cached_epoch(models[mode], loaders[mode], opt, device))
        ready1, asked1 = _ready_and_asked(conn)
    hit_ratio = (ready1 - ready0) / (asked1 - asked0) if asked1 > asked0 else 0.0
    return {mode: _combine(parts) for mode, parts in runs.items()}, hit_ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,048 images, 2 timed epochs per mode, both depths")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per mode")
    parser.add_argument("--frozen", type=int, nargs="+", default=[5, 10],
                        help="frozen depths (ResNet-20 has 11 stages: stem, 9 blocks, head); 5 and 10 give the figures")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the trainer's own work per step is small)")
    parser.add_argument("--store-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="precision of the stored entries (CachedForward(store_dtype=...))")
    parser.add_argument("--device", default="cpu", help="where the model trains (cpu, cuda)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.epochs = 2048, 2
    torch.set_num_threads(args.threads)
    dataset = JpegSet(resolve_data_dir(args.data_dir), "train", limit=args.samples)
    results = {}
    with run_daemon() as daemon:
        for frozen in args.frozen:
            rows, hit_ratio = run_depth(daemon, dataset, frozen, args)
            results[frozen] = {"rows": rows, "train_prefetch_hit_ratio": hit_ratio}
            print(f"ResNet-20, frozen {frozen}/11, batch {args.batch}, {args.samples} samples x {args.epochs} epochs, "
                  f"{args.threads} torch thread(s), entries stored as {args.store_dtype}, on {args.device}")
            print(f"{'mode':<16}{'ms/step':>9}" + "".join(f"{c[:-3]:>16}" for c in COLUMNS) + "   (ms/step)")
            for mode, r in rows.items():
                print(f"{mode:<16}{r['step_ms']:>9.1f}" + "".join(f"{r[c]:>16.1f}" for c in COLUMNS))
            cached = rows["cached"]
            print(f"cached: {cached['cached_samples']} of {cached['samples']} samples served, "
                  f"{cached['raw_loaded']} raw items loaded; entries ready when asked {hit_ratio:.1%}\n")
    figures = {}
    if 5 in results:
        rows = results[5]["rows"]
        figures["cached_vs_ideal"] = rows["cached"]["step_ms"] / rows["ideal"]["step_ms"]
        figures["cached_step_speedup"] = rows["recompute"]["step_ms"] / rows["cached"]["step_ms"]
        figures["audit_overhead"] = rows["cached"]["step_ms"] / rows["cached-noaudit"]["step_ms"]
    if 10 in results:
        rows = results[10]["rows"]
        figures["cached_vs_ideal_fast"] = rows["cached"]["step_ms"] / rows["ideal"]["step_ms"]
    if results:
        figures["train_prefetch_hit_ratio"] = min(r["train_prefetch_hit_ratio"] for r in results.values())
        figures["raw_items_loaded_share"] = max(r["rows"]["cached"]["raw_loaded"] / r["rows"]["cached"]["samples"]
                                                for r in results.values())
    if args.json:
        args.json.write_text(json.dumps({"results": results, "figures": figures}, indent=2))
    for name in ("cached_vs_ideal", "cached_vs_ideal_fast", "train_prefetch_hit_ratio", "raw_items_loaded_share",
                 "cached_step_speedup", "audit_overhead"):
        if name in figures:
            print(f"figure: {name} = {figures[name]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
