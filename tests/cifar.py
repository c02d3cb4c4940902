"""A small real-image data set for tests: a CIFAR-10 subset, or generated images when it is absent.

The subset lives in ``$ACTCACHE_DATA/cifar10/train_2000_per_class.npz``, else
in the nearest ``shared/data`` beside a parent of the repository
(``<repo>/../shared/data``; a git worktree may sit one level deeper) as JPEG
bytes + offsets + labels, sorted
by class; see the README next to it). Without it, images are generated with
a class-dependent colour and stripe pattern plus noise, so a model can learn.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

MEAN = (0.4926, 0.4828, 0.4471)
STD = (0.2457, 0.2435, 0.2611)
_FILE = Path("cifar10") / "train_2000_per_class.npz"


def data_root() -> Path | None:
    env = os.environ.get("ACTCACHE_DATA")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[1]
    return next((p / "shared" / "data" for p in repo.parents if (p / "shared" / "data").is_dir()), None)


def cifar_subset(per_class: int = 32) -> tuple[TensorDataset, str]:
    """``per_class`` images of each of the 10 classes, normalized, as (N, 3, 32, 32); and the source."""
    root = data_root()
    path = root / _FILE if root is not None else None
    if path is None or not path.exists():
        return generated(per_class), "generated"
    from PIL import Image

    with np.load(path, allow_pickle=False) as npz:
        data, offsets, labels = npz["jpeg_bytes"], npz["offsets"], npz["labels"]
    rows = np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in range(10)])
    images = np.stack([np.asarray(Image.open(io.BytesIO(data[offsets[i]:offsets[i + 1]].tobytes())).convert("RGB"))
                       for i in rows])
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    x = (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]
    return TensorDataset(x, torch.from_numpy(labels[rows].astype(np.int64))), "cifar10"


def generated(per_class: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(10).repeat_interleave(per_class)
    colour = torch.randn(10, 3, 1, 1, generator=g)
    stripes = torch.sin(torch.arange(32.0)[None, :] * (labels[:, None] + 1) / 4)[:, None, :, None]
    x = colour[labels] + stripes + 0.5 * torch.randn(len(labels), 3, 32, 32, generator=g)
    return TensorDataset(x, labels)
