"""A digits CNN converted to actcache as a newcomer would: what ``variants=K`` and a fill epoch cost, end to end.

    python bench/bench_loader.py [--quick] [--device cpu|cuda] [--repeats N] [--epochs E] [--limit N] [--workers W]

scikit-learn's 8x8 digits (80% train split: 1,437 images, batch 64), a small CNN (three convolutions, the
first six modules frozen), a random crop and flip in ``__getitem__`` drawn from torch's global generator.
Three comparisons, every pair taking turns (A, B, A, B, ...), min and median of each side:

- ``variants_overhead``: a training epoch loading every input (nothing frozen) through ``cache.wrap(loader,
  variants=2)`` / through ``cache.wrap(loader)`` (the same loader without variants: the seeding's cost);
  ``variants_vs_plain_loader``: the same epoch / through the plain DataLoader. The loader alone (no step) is
  shown beside it, also with ``--workers`` DataLoader workers; ``seeding_share``: the loader pass's extra
  seconds with ``variants=2`` over a loaded epoch's (steadier than the epochs' ratio on a busy machine).
- ``fill_overhead``: the first epoch after ``cache.freeze(6)`` (computes and stores the prefix; no
  augmentation) / an epoch frozen by hand (``requires_grad_(False)``), both on a fresh run (12 turns at least);
  the daemon's CPU seconds storing the fill epoch's entries are shown beside it.
- ``train_vs_hand``: a whole run with augmentation, ``variants=2``, frozen at epoch 3 of 12, through actcache /
  the same run frozen by hand (seconds of training, below 1 means actcache is faster).

Sample output (2-core VM, ``--quick``, 2026-11-29)::

    loader pass, plain loader                        0.033 s (min)   0.033 s (median)
    loader pass, variants=2                          0.046 s (min)   0.046 s (median)  1.40x
    loaded epoch, plain loader                       0.373 s (min)   0.381 s (median)
    loaded epoch, cache.wrap(loader)                 0.382 s (min)   0.392 s (median)  1.02x
    loaded epoch, cache.wrap(loader, variants=2)     0.386 s (min)   0.411 s (median)  1.03x
      seeding: variants=2 / cache.wrap(loader)     1.01x
      seeding per epoch (loader passes)              0.013 s = 3.5% of a loaded epoch
    loader pass, 2 workers, plain                    0.055 s (min)   0.055 s (median)
    loader pass, 2 workers, variants=2               0.076 s (min)   0.078 s (median)  1.39x
    first frozen epoch, frozen by hand               0.136 s (min)   0.140 s (median)
    first frozen epoch, actcache (fill)              0.153 s (min)   0.169 s (median)  1.13x
      the daemon storing its entries (CPU)           0.033 s (mean)
    12 epochs augmented, frozen by hand              2.512 s (min)   2.521 s (median)
    12 epochs augmented, actcache                    2.103 s (min)   2.152 s (median)  0.84x
    figure: variants_overhead = 1.01
    figure: variants_vs_plain_loader = 1.03
    figure: seeding_share = 0.04
    figure: fill_overhead = 1.13
    figure: train_vs_hand = 0.84
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import uuid
import warnings
from typing import Callable

import psutil
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac
from actcache.testing import run_daemon

FROZEN = 6  # conv1, relu, conv2, relu, conv3, relu


class Digits(Dataset):
    """scikit-learn's digits (first 80%: 1,437 images) as 1x8x8 floats; ``augment``: a random 1-pixel crop of the
    padded image and a random flip, drawn from torch's global generator."""

    def __init__(self, augment: bool, limit: int | None = None) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        n = int(len(digits.target) * 0.8) if limit is None else limit
        self.images = torch.tensor(digits.images[:n], dtype=torch.float32).unsqueeze(1) / 16
        self.targets = [int(t) for t in digits.target[:n]]
        self.augment = augment

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.images[i]
        if self.augment:
            dy, dx = torch.randint(0, 3, (2,)).tolist()
            x = F.pad(x, (1, 1, 1, 1))[:, dy:dy + 8, dx:dx + 8]
            if torch.rand(()) < 0.5:
                x = x.flip(-1)
        return x, self.targets[i]


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10))


class Run:
    """One training run: a network, its optimizer and its loader, through actcache (``conn``) or plain."""

    def __init__(self, data: Dataset, device: str, conn: Callable[[], ac.Connection] | None, variants: int | None,
                 workers: int = 0):
        self.net = cnn().to(device)
        self.device = device
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)
        loader = DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1),
                            num_workers=workers, persistent_workers=workers > 0)
        self.cache = ac.ActCache(self.net, conn()) if conn is not None else None
        self.loader = self.cache.wrap(loader, variants=variants) if self.cache is not None else loader

    def freeze(self) -> None:
        if self.cache is not None:
            self.cache.freeze(FROZEN)
        else:
            self.net[:FROZEN].requires_grad_(False)

    def epoch(self) -> float:
        """Seconds of one training epoch."""
        t0 = time.perf_counter()
        for x, y in self.loader:
            x, y = x.to(self.device), y.to(self.device)
            loss = F.cross_entropy(self.net(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


def pass_s(loader) -> float:
    """Seconds of one pass over ``loader`` with no step."""
    t0 = time.perf_counter()
    collections.deque(loader, maxlen=0)  # drawn and dropped: the loader's own work only
    return time.perf_counter() - t0


def turns(repeats: int, a: Callable[[], float], b: Callable[[], float]) -> tuple[list[float], list[float]]:
    """``repeats`` measurements of ``a`` and of ``b``, taking turns."""
    out_a, out_b = [], []
    for _ in range(repeats):
        out_a.append(a())
        out_b.append(b())
    return out_a, out_b


def row(name: str, values: list[float], baseline: list[float] | None = None) -> None:
    ratio = f"  {min(values) / min(baseline):.2f}x" if baseline else ""
    print(f"{name:<46} {min(values):7.3f} s (min) {statistics.median(values):7.3f} s (median){ratio}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats (default 5)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=12, help="of the end-to-end runs (frozen at epoch 3)")
    parser.add_argument("--limit", type=int, default=None, help="images (default: the 1,437 of the train split)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 leaves a core to the daemon)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of the loader-only rows (0: none)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    augmented, plain = Digits(True, args.limit), Digits(False, args.limit)
    print(f"# {' '.join(sys.argv)}: {len(plain)} images, batch 64, {repeats} repeats taking turns, {args.device}")
    figures: dict[str, float] = {}
    with run_daemon() as daemon:
        def conn() -> ac.Connection:
            return ac.connect(daemon.socket, namespace=f"loader-{uuid.uuid4().hex[:8]}")

        # variants: a loaded epoch (nothing frozen) with and without the per-(sample, variant) seeding
        bare, seeded = Run(augmented, args.device, None, None), Run(augmented, args.device, conn, 2)
        with warnings.catch_warnings():  # not cached without variants: said by an UncacheableDataWarning
            warnings.simplefilter("ignore", ac.UncacheableDataWarning)
            unseeded = Run(augmented, args.device, conn, None)
        pass_s(seeded.loader), pass_s(unseeded.loader)  # warm-up (the wraps' first pass)
        loads_bare, loads_seeded = turns(repeats, lambda: pass_s(bare.loader), lambda: pass_s(seeded.loader))
        epochs: dict[str, list[float]] = {"plain": [], "wrapped": [], "variants": []}
        for _ in range(repeats + 8):  # three sides, an epoch each: more turns than the others
            for name, run in (("plain", bare), ("wrapped", unseeded), ("variants", seeded)):
                epochs[name].append(run.epoch())
        seeded.close(), unseeded.close()
        row("loader pass, plain loader", loads_bare)
        row("loader pass, variants=2", loads_seeded, loads_bare)
        row("loaded epoch, plain loader", epochs["plain"])
        row("loaded epoch, cache.wrap(loader)", epochs["wrapped"], epochs["plain"])
        row("loaded epoch, cache.wrap(loader, variants=2)", epochs["variants"], epochs["plain"])
        print(f"{'  seeding: variants=2 / cache.wrap(loader)':<46} {min(epochs['variants']) / min(epochs['wrapped']):.2f}x")
        figures["variants_overhead"] = min(epochs["variants"]) / min(epochs["wrapped"])
        figures["variants_vs_plain_loader"] = min(epochs["variants"]) / min(epochs["plain"])
        # the seeding's seconds (loader passes: short, so steadier than epochs) over a loaded epoch
        seeding_s = min(loads_seeded) - min(loads_bare)
        print(f"{'  seeding per epoch (loader passes)':<46} {seeding_s:7.3f} s = {seeding_s / min(epochs['plain']):.1%} "
              "of a loaded epoch")
        figures["seeding_share"] = seeding_s / min(epochs["plain"])
        if args.workers:
            bare_w = Run(augmented, args.device, None, None, args.workers)
            seeded_w = Run(augmented, args.device, conn, 2, args.workers)
            pass_s(bare_w.loader), pass_s(seeded_w.loader)  # the workers start
            loads_bare_w, loads_seeded_w = turns(repeats, lambda: pass_s(bare_w.loader), lambda: pass_s(seeded_w.loader))
            seeded_w.close()
            row(f"loader pass, {args.workers} workers, plain", loads_bare_w)
            row(f"loader pass, {args.workers} workers, variants=2", loads_seeded_w, loads_bare_w)

        # fill: the first epoch after a freeze (compute and store) against an epoch frozen by hand
        daemon_process, daemon_cpu = psutil.Process(daemon.pid), []

        def first_frozen_epoch(through: Callable[[], ac.Connection] | None) -> float:
            run = Run(plain, args.device, through, None)
            run.epoch()
            run.freeze()
            cpu_before = sum(daemon_process.cpu_times()[:2])
            seconds = run.epoch()
            if run.cache is not None:  # the daemon's CPU seconds for the epoch's entries, stored once flushed
                run.cache.connection.flush()
                daemon_cpu.append(sum(daemon_process.cpu_times()[:2]) - cpu_before)
            run.close()
            return seconds

        # one short epoch a side: more turns than the others, so that each side's min is an undisturbed epoch
        hand, fill = turns(max(repeats, 12), lambda: first_frozen_epoch(None), lambda: first_frozen_epoch(conn))
        row("first frozen epoch, frozen by hand", hand)
        row("first frozen epoch, actcache (fill)", fill, hand)
        # the mean over the turns: the process's CPU times count in clock ticks (10 ms), a fill epoch's in a few
        print(f"{'  the daemon storing its entries (CPU)':<46} {statistics.mean(daemon_cpu):7.3f} s (mean)")
        figures["fill_overhead"] = min(fill) / min(hand)

        # end to end, with augmentation: actcache (variants=2) against the hand freeze
        def whole_run(through: Callable[[], ac.Connection] | None) -> float:
            run = Run(augmented, args.device, through, 2 if through is not None else None)
            seconds = 0.0
            for epoch in range(args.epochs):
                if epoch == min(3, args.epochs - 1):
                    run.freeze()
                seconds += run.epoch()
            run.close()
            return seconds

        hand_runs, cached_runs = turns(max(1, repeats - 1), lambda: whole_run(None), lambda: whole_run(conn))
        row(f"{args.epochs} epochs augmented, frozen by hand", hand_runs)
        row(f"{args.epochs} epochs augmented, actcache", cached_runs, hand_runs)
        figures["train_vs_hand"] = min(cached_runs) / min(hand_runs)
    for name, value in figures.items():
        print(f"figure: {name} = {value:.2f}")
    return figures


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        main()
