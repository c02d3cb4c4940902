"""What ``ActCache.wrap`` checks of the user's loader and dataset before wrapping them.

``check_loader``: a DataLoader with automatic batching, not wrapped yet. ``uncontrolled_randomness``: whether
the dataset's items change from one load to the next in a way actcache cannot seed (eight loads of item 0),
said as an UncacheableDataWarning that names the fix.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from actcache.errors import ConfigError
from actcache_client.data._loader import UncacheableDataWarning
from actcache_client.data._seeding import seeded_item

__all__ = ["check_loader", "uncontrolled_randomness"]

_LOADS = 8


def check_loader(loader: Any) -> None:
    """ConfigError naming the fix unless ``loader`` is a DataLoader with automatic batching."""
    if type(loader).__name__ == "WrappedLoader":
        raise ConfigError("this loader is already wrapped by ActCache.wrap; iterate over it as it is")
    if not isinstance(loader, DataLoader):
        what = f"a {type(loader).__module__}.{type(loader).__qualname__}"
        raise ConfigError(
            f"ActCache.wrap takes the torch DataLoader the loop iterates over, got {what}; build one over the "
            "dataset and wrap that: cache.wrap(DataLoader(dataset, batch_size=64, shuffle=True))")
    if loader.batch_sampler is None:
        raise ConfigError("ActCache.wrap needs a DataLoader with batch_size or batch_sampler (automatic batching), "
                          "got batch_size=None")


def uncontrolled_randomness(dataset: Any, variants: int | None) -> bool:
    """Whether ``dataset``'s items are random in a way the cache cannot reproduce (warned, naming the fix).

    Without ``variants``: loads of item 0 under different seeds differ (random augmentation in ``__getitem__``;
    a transform applied with probability p goes unnoticed in eight loads with probability p^8 + (1-p)^8).
    With ``variants``: two loads under the same seed differ (the dataset draws from a generator of its own,
    which seeding the global generators cannot reach)."""
    if variants is None:
        first = seeded_item(dataset, 0, 0)
        if all(_equal(first, seeded_item(dataset, 0, seed)) for seed in range(1, _LOADS)):
            return False
        warnings.warn("actcache: not caching: the dataset's items change from one load to the next (random "
                      "augmentation in __getitem__); pass variants=K to ActCache.wrap to cache K augmented "
                      "versions of each sample", UncacheableDataWarning, stacklevel=4)
        return True
    if all(_equal(seeded_item(dataset, 0, seed), seeded_item(dataset, 0, seed)) for seed in range(_LOADS // 2)):
        return False
    warnings.warn(f"actcache: not caching: with variants={variants}, two loads of item 0 under the same seed "
                  "differ: __getitem__ draws from a random generator of its own (a torch.Generator, "
                  "np.random.default_rng(), random.Random()), which actcache cannot seed; draw from the global "
                  "generators instead (torch.rand(..., generator=None), np.random.rand, random.random), which "
                  "actcache seeds per (sample, variant)", UncacheableDataWarning, stacklevel=4)
    return True


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b
