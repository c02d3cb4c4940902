"""How far a recomputed frozen prefix drifts from the stored one: the numbers behind the audit tolerances.

    python bench/bench_audit_tolerance.py [--device cuda] [--samples 1024]

An entry is stored from a batch of ``--batch`` and audited later by recomputing
a few samples (``AuditConfig.group``) in a smaller batch. Kernels differ between
batch sizes, so the two outputs are not bit-equal. For ResNet-20 on CIFAR-10
JPEGs at the benchmark depths, this prints the audit's own statistic
(max |stored - recomputed| / max |recomputed|, per sample) over every sample,
for each float32 precision setting of the device (on CUDA: TF32 off and on,
TF32 being PyTorch's default for convolutions), next to the tolerance the
audit applies there (``actcache_client.engine._audit.tolerances``).

Ends with ``figure: audit_margin = R``: the tolerance applied / the largest
deviation seen, over every setting (above 1: no valid entry is flagged; inf:
every recomputation was bit-equal).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads.data import JpegSet, resolve_data_dir  # noqa: E402

import actcache_client as ac  # noqa: E402
from actcache_client.engine._audit import tolerances
from actcache_client.models import resnet20  # noqa: E402


def _set_tf32(on: bool) -> None:
    torch.backends.cudnn.allow_tf32 = on
    torch.backends.cuda.matmul.allow_tf32 = on


def deviations(staged: ac.StagedModel, images: torch.Tensor, depth: int, batch: int, group: int) -> torch.Tensor:
    """Per sample: max |stored - recomputed| / max |recomputed|, stored in batches of ``batch``, recomputed in ``group``s."""
    with torch.no_grad():
        stored = torch.cat([staged.run(images[lo : lo + batch], 0, depth) for lo in range(0, len(images), batch)])
        again = torch.cat([staged.run(images[lo : lo + group], 0, depth) for lo in range(0, len(images), group)])
    diff = (stored - again).flatten(1).abs().amax(1)
    return diff / again.flatten(1).abs().amax(1).clamp_min(1e-6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--group", type=int, default=8, help="samples recomputed together by an audit")
    parser.add_argument("--depths", type=int, nargs="+", default=[5, 10])
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dataset = JpegSet(resolve_data_dir(args.data_dir), "train", limit=args.samples)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))]).to(device)
    torch.manual_seed(0)
    staged = ac.from_resnet(resnet20()).to(device).eval()
    settings = [False, True] if device.type == "cuda" else [False]
    margin = float("inf")
    print(f"ResNet-20, {len(images)} samples stored in batches of {args.batch}, recomputed in groups of {args.group}, "
          f"on {device}")
    print(f"{'depth':>5} {'tf32':>5} {'median':>10} {'p99':>10} {'max':>10} {'tolerance':>10}")
    for tf32 in settings:
        _set_tf32(tf32)
        tolerance = tolerances(device)[torch.float32]
        for depth in args.depths:
            d = deviations(staged, images, depth, args.batch, args.group).double().cpu()
            worst = float(d.max())
            if worst > 0:
                margin = min(margin, tolerance / worst)
            print(f"{depth:>5} {str(tf32):>5} {float(d.median()):>10.2e} {float(d.quantile(0.99)):>10.2e} "
                  f"{worst:>10.2e} {tolerance:>10.0e}")
    print(f"figure: audit_margin = {margin:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
