"""Capacity planning for N nodes: per-node cache bytes, disk and network traffic per epoch, expected hit ratio.

    python bench/capacity.py [--samples 50000] [--depth 4] [--epochs 10] [--raw-bytes 3072]
                             [--nodes 2 4 8 16 32 64 128 256] [--json PATH]

Entry sizes come from ResNet-20's stage outputs (``actcache_client.models``):
a batch of 128 CIFAR-shaped inputs runs through the stages and one sample's
output at each depth is encoded as the client stores it (fp32, codec header,
no zstd: ReLU outputs compress, so this is an upper bound).

Model of a run of ``--epochs`` epochs with the prefix frozen (cached) from
the first one, S samples, P nodes, entry size B, raw input size R:

- node-stable sampler: a node stores its shard, S/P entries, in the first
  epoch and hits every later one (hit ratio 1; shards that differ by one
  canonical node aside). Per epoch after the first: reads S/P * B from disk,
  writes nothing, loads no raw inputs (hits are never loaded).
- DistributedSampler (global shuffle): a sample meets a uniformly random
  node each epoch, so in epoch e (e >= 2) it is stored on that node with
  probability 1 - (1 - 1/P)^(e-1): that is the expected hit ratio. Every
  miss is computed, written (B) and its raw input loaded (R, from shared
  storage over the network when the data is not on the node), and every
  node ends up storing the whole dataset (S * B) after about P * ln(P)
  epochs.

No activation crosses the network in either case: each daemon serves its
own node. "net" below is the raw input bytes a node loads for its misses.
Sample output (the default CIFAR-10 train set, depth 4 = stem + layer1; all of it in docs/benchmarks.md):

      depth  4 (layer1.2 )  16x32x32    65,600 B
    ...
    nodes  sampler           cache  hit e2  hit mean   disk read  disk write   net (raw)  recomputed
        4  node-stable   782.0 MiB   1.000     1.000   782.0 MiB         0 B         0 B           0
        4  global          2.9 GiB   0.250     0.692   540.9 MiB   241.1 MiB    11.3 MiB       3,854
      256  global        120.1 MiB   0.004     0.019   241.9 KiB    12.0 MiB   574.6 KiB         192
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from actcache_client.layouts._stages import from_resnet
from actcache_client.models import resnet20
from actcache_client.transport._tensors import encode_samples

__all__ = ["entry_bytes", "expected_global_hit_ratio", "plan", "resnet20_entry_bytes"]


def resnet20_entry_bytes(batch: int = 128) -> list[tuple[int, str, int, tuple[int, ...]]]:
    """(depth, last frozen stage, bytes per stored entry, per-sample shape) for every prefix of ResNet-20."""
    staged = from_resnet(resnet20().eval())
    state = torch.zeros(batch, 3, 32, 32)
    rows = []
    with torch.no_grad():
        for depth, stage in enumerate(list(staged.stages)[:-1], start=1):
            state = stage(state)
            rows.append((depth, stage.name, len(encode_samples(state[:1])[0]), tuple(state.shape[1:])))
    return rows


def entry_bytes(depth: int) -> int:
    """Bytes of one ResNet-20 entry at ``depth`` (1 = after the stem)."""
    return next(b for d, _, b, _ in resnet20_entry_bytes() if d == depth)


def expected_global_hit_ratio(nodes: int, epoch: int) -> float:
    """Hit ratio of epoch ``epoch`` (1-based; epoch 1 stores) with a DistributedSampler over ``nodes`` nodes."""
    return 1.0 - (1.0 - 1.0 / nodes) ** (epoch - 1)


def plan(samples: int, nodes: int, entry: int, raw: int, epochs: int, node_stable: bool) -> dict[str, Any]:
    """Per-node figures of one configuration: bytes stored, per-epoch disk and network traffic, hit ratio."""
    per_node = samples / nodes  # samples a node's ranks see per epoch, either way
    if node_stable:
        hits = [0.0] + [1.0] * (epochs - 1)
    else:
        hits = [expected_global_hit_ratio(nodes, e) for e in range(1, epochs + 1)]
    stored = per_node if node_stable else samples * (1.0 - (1.0 - 1.0 / nodes) ** epochs)
    later = hits[1:] or [0.0]
    mean_hit = sum(later) / len(later)
    return {
        "nodes": nodes,
        "sampler": "node-stable" if node_stable else "global",
        "cache_bytes": stored * entry,
        "hit_ratio_epoch2": hits[1] if epochs > 1 else 0.0,
        "hit_ratio_mean": mean_hit,
        # per epoch after the first, averaged over those epochs
        "disk_read_bytes": per_node * mean_hit * entry,
        "disk_write_bytes": per_node * (1.0 - mean_hit) * entry,
        "net_bytes": per_node * (1.0 - mean_hit) * raw,
        "recomputed_samples": per_node * (1.0 - mean_hit),
        "epochs_to_full_copy": None if node_stable else math.ceil(nodes * math.log(max(nodes, 2))),
    }


def _size(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=50_000, help="dataset size (default: CIFAR-10 train)")
    p.add_argument("--depth", type=int, default=4, help="frozen depth of ResNet-20 (1 = stem; 4 = stem + layer1)")
    p.add_argument("--epochs", type=int, default=10, help="epochs with the prefix frozen")
    p.add_argument("--raw-bytes", type=int, default=3 * 32 * 32, help="raw input bytes per sample (uint8 CIFAR image)")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be >= 2 (the first epoch stores, later ones hit)")

    table = resnet20_entry_bytes()
    print("ResNet-20 entry bytes per depth (batch 128 through the stages, one sample encoded, fp32, no zstd):")
    for depth, name, nbytes, shape in table:
        print(f"  depth {depth:2d} ({name:10s}) {'x'.join(map(str, shape)):>9s}  {nbytes:>8,d} B")
    entry = entry_bytes(args.depth)
    print(f"\n{args.samples:,} samples, depth {args.depth} ({entry:,} B/entry, whole dataset "
          f"{_size(args.samples * entry)}), {args.epochs} epochs; per node, traffic per epoch after the first:")
    header = (f"{'nodes':>5s}  {'sampler':11s}  {'cache':>10s}  {'hit e2':>6s}  {'hit mean':>8s}  "
              f"{'disk read':>10s}  {'disk write':>10s}  {'net (raw)':>10s}  {'recomputed':>10s}")
    print(header)
    rows = []
    for nodes in args.nodes:
        for stable in (True, False):
            r = plan(args.samples, nodes, entry, args.raw_bytes, args.epochs, stable)
            rows.append(r)
            print(f"{nodes:5d}  {r['sampler']:11s}  {_size(r['cache_bytes']):>10s}  {r['hit_ratio_epoch2']:6.3f}  "
                  f"{r['hit_ratio_mean']:8.3f}  {_size(r['disk_read_bytes']):>10s}  "
                  f"{_size(r['disk_write_bytes']):>10s}  "
                  f"{_size(r['net_bytes']):>10s}  {r['recomputed_samples']:10,.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"entries": table, "rows": rows, "args": vars(args) | {"json": str(args.json)}},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
